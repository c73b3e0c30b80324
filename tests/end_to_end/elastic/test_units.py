"""Fast, single-process checks of the elastic pieces: the store handshake against stale keys,
auto_resume's choice, the new config keys' errors, the watchdog's diagnosis, ``lmforge env``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lmforge.cli import main
from lmforge.config import load_config, validate_section
from lmforge.errors import ConfigError
from lmforge.train.checkpoint import resume, write_tracker
from lmforge.train.watchdog import HangWatchdog
from lmforge.utils.elastic import NAMESPACE, agree_generation


def run_ranks(store_factory, world: int) -> list[int]:
    out = [0] * world
    errors: list[BaseException] = []

    def join(r: int) -> None:
        try:
            out[r] = agree_generation(store_factory(), r, world, 20.0)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_handshake_gives_every_attempt_a_fresh_generation_despite_stale_keys():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, is_master=False)

    first = run_ranks(client, 4)
    assert len(set(first)) == 1
    # A dead attempt leaves its keys behind, and a queued rank that never took its answer.
    slot = server.add(f"{NAMESPACE}/queue_len", 1)
    server.set(f"{NAMESPACE}/queue/{slot}", "stale-nonce")
    second = run_ranks(client, 4)
    assert len(set(second)) == 1 and second[0] != first[0]
    # The process group's keys live under the generation: nothing of the first attempt is visible.
    old = dist.PrefixStore(f"{NAMESPACE}/gen{first[0]}/", client())
    new = dist.PrefixStore(f"{NAMESPACE}/gen{second[0]}/", client())
    old.set("default_pg/0/address", "dead:1234")
    assert not new.check(["default_pg/0/address"])


def test_auto_resume_modes(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    ck = {"save_path": str(save), "enable_save": True, "load_path": "/weights/hf"}

    def auto_resume_path(section):  # of the typed section, as load_config makes it
        return resume.auto_resume_path(validate_section("checkpoint", section))

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert auto_resume_path({**ck, "auto_resume": "auto"}) is None  # nothing saved yet
    save.mkdir()
    write_tracker(save, 4)
    assert auto_resume_path({**ck, "auto_resume": "auto"}) == str(save)
    assert auto_resume_path({**ck, "auto_resume": False}) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert auto_resume_path({**ck, "auto_resume": "auto"}) is None  # a fresh launch: the original's meaning
    assert auto_resume_path({**ck, "auto_resume": True}) == str(save)
    with pytest.raises(ConfigError, match="auto_resume: true needs checkpoint.enable_save"):
        auto_resume_path({**ck, "auto_resume": True, "enable_save": False})  # refused at load


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("checkpoint.auto_resume=sometimes", "checkpoint.auto_resume"),
        (
            "parallelism.process_group_timeout=0",
            "parallelism.process_group_timeout must be a positive, finite number",
        ),
        # accepted before, then an OverflowError traceback from timedelta at a torchrun start-up
        (
            "parallelism.process_group_timeout=.inf",
            "parallelism.process_group_timeout must be a positive, finite number",
        ),
        ("parallelism.process_group_timeout=1e300", "at most 604800: a week"),
    ],
)
def test_new_keys_refuse_bad_values(base_config, override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(base_config, [override])


def test_auto_resume_true_needs_saving(base_config):
    base_config["checkpoint"] = {"auto_resume": True, "enable_save": False}
    with pytest.raises(ConfigError, match=r"checkpoint\.auto_resume: true needs checkpoint\.enable_save"):
        load_config(base_config)


def test_watchdog_names_the_stalled_rank_from_a_waiting_one():
    store = dist.HashStore()
    stuck = HangWatchdog(5.0, rank=1, world_size=3, store=store)
    stuck.enter("after step 5: callbacks (logging, evaluation, checkpoint save)")
    HangWatchdog(5.0, rank=2, world_size=3, store=store).enter("after step 5: stop agreement", waiting=True)
    waiting = HangWatchdog(5.0, rank=0, world_size=3, store=store)
    waiting.enter("after step 5: stop agreement (waits for all ranks)", waiting=True)
    text = waiting.diagnose(6.0)
    assert text.startswith("rank 0 made no progress for 6 s (parallelism.process_group_timeout = 5 s)")
    assert "It was waiting for rank 1 in 'after step 5: callbacks" in text and "rank 2 in" not in text
    own = stuck.diagnose(6.0)
    assert "Rank 1 itself is stalled here" in own
    assert json.loads(store.get("lmforge/phase/1"))["waiting"] is False


def test_watchdog_stops_publishing_to_a_store_that_is_gone():
    class GoneStore:
        sets = 0

        def set(self, key, value):
            GoneStore.sets += 1
            raise RuntimeError("Broken pipe")  # torchrun's agent (the store's host) was killed

    dog = HangWatchdog(5.0, rank=0, world_size=2, store=GoneStore())
    for step in range(3):
        dog.enter(f"step {step}")
    assert GoneStore.sets == 1 and dog.store is None and dog.phase == "step 2"
    assert dog.peer_phases() == {}


def test_env_prints_one_process_view(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "world size      : 1 rank(s) on 1 node(s)" in out and "torch " in out
    assert main(["env", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_size"] == 1 and summary["ranks"][0]["backend"] in ("gloo", "nccl")


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "1e300"])
def test_env_refuses_a_timeout_that_cannot_be_waited(capsys, timeout):
    # Before: accepted on one process (unused there), while under torchrun timedelta(seconds=) raised
    # on NaN (ValueError) and inf / 1e300 (OverflowError), and 0 or a negative wait is no wait at all.
    assert main(["env", "--timeout", timeout]) == 2
    err = capsys.readouterr().err
    assert f"--timeout {float(timeout):g}: expected the seconds to wait" in err and "Traceback" not in err, (
        err
    )


@pytest.mark.slow
def test_a_rank_missing_at_start_up_is_reported_within_the_timeout():
    from datetime import timedelta

    from lmforge.utils.elastic import DistributedStartError

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(
        DistributedStartError, match=r"rank 0: only 0 of the 1 other ranks joined .*phase: rendezvous"
    ):
        agree_generation(server, 0, 2, 0.5)
    lone = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=0.5))
    with pytest.raises(DistributedStartError, match=r"rank 1: rank 0 did not answer .*phase: rendezvous"):
        agree_generation(lone, 1, 2, 0.5)
    assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_a_stalled_rank_exits_with_status_3_naming_its_phase():
    # The status torchrun sees from a hung rank (docs/guide.md); the two-rank hang test cannot see it when
    # torchrun reports the other rank, whose failure it observed at the same moment.
    script = (
        "import time\n"
        "from lmforge.train.watchdog import HangWatchdog\n"
        "dog = HangWatchdog(0.2, rank=1, world_size=2)\n"
        "dog.on_train_begin(None, type('S', (), {'global_step': 4})())\n"
        "dog.enter('after step 5: callbacks')\n"
        "time.sleep(30)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert "rank 1 made no progress" in out.stderr and "after step 5: callbacks" in out.stderr
