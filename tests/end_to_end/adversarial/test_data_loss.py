"""Class 2: a failed or interrupted command leaves what existed before untouched and usable."""

from __future__ import annotations

import errno
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import Checkpointable, CheckpointManager, read_tracker, resolve_checkpoint
from lmforge.train.checkpoint import manager as ckpt_mod
from lmforge.utils import atomic as atomic_mod
from lmforge.utils.run_lock import LOCK_FILE

from .conftest import snapshot

REPO = Path(__file__).resolve().parents[3]
ITER = "iteration_00000002"


def _no_temporaries(root: Path) -> None:
    left = [p.name for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith((".partial", ".old"))]
    assert not left, left


# -- data preprocess ------------------------------------------------------------------------------


def _preprocess(cli, run, src, prefix):
    return cli(
        "data",
        "preprocess",
        "--input",
        src,
        "--tokenizer",
        run / "data" / "tokenizer.json",
        "--output-prefix",
        prefix,
        "--append-eod",
    )


@pytest.fixture
def dataset(run_copy, cli, tmp_path):
    src = tmp_path / "good.jsonl"
    src.write_text("".join(json.dumps({"text": "t1 t2 t3 t4"}) + "\n" for _ in range(20)))
    code, _, err = _preprocess(cli, run_copy, src, tmp_path / "out" / "corpus")
    assert code == 0, err
    return tmp_path / "out"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"text": "t1 t2"}\n{"text": "t3"\n', "is not valid JSON"),
        (b'{"text": "t1 t2"}\n{"body": "t3"}\n', "has no key 'text'"),
        (b'{"text": "t1 t2"}\n{"text": "\xff\xfe t3"}\n', "is not valid UTF-8"),
    ],
    ids=["bad-json-line", "missing-key", "invalid-utf8"],
)
def test_failed_preprocess_keeps_the_dataset_at_its_prefix(run_copy, cli, tmp_path, dataset, content, needle):
    before = snapshot(dataset)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    code, _, err = _preprocess(cli, run_copy, bad, dataset / "corpus")
    assert code == 2 and needle in err and "Traceback" not in err
    assert snapshot(dataset) == before
    _no_temporaries(dataset)


@pytest.mark.parametrize("kind", ["not-gzip", "truncated-gzip"])
def test_fake_gz_input_is_refused_and_keeps_the_dataset(run_copy, cli, tmp_path, dataset, kind):
    before = snapshot(dataset)
    fake = tmp_path / "input.jsonl.gz"
    data = gzip.compress(b'{"text": "t1 t2"}\n' * 2000)
    fake.write_bytes(b'{"text": "plain"}\n' if kind == "not-gzip" else data[: len(data) // 2])
    code, _, err = _preprocess(cli, run_copy, fake, dataset / "corpus")
    assert code == 2 and "gzip" in err and "Traceback" not in err
    assert snapshot(dataset) == before


def test_preprocess_output_prefix_under_a_file(run_copy, cli, tmp_path, dataset):
    (tmp_path / "afile").write_text("x")
    code, _, err = _preprocess(cli, run_copy, tmp_path / "good.jsonl", tmp_path / "afile" / "corpus")
    assert code == 2 and "afile' is a file" in err


# -- convert ---------------------------------------------------------------------------------------


@pytest.fixture
def hf_dir(run_copy, cli, tmp_path):
    code, _, err = cli("convert", "--from", run_copy / "ckpt", "--to-hf", tmp_path / "hf")
    assert code == 0, err
    return tmp_path / "hf"


def test_convert_into_a_training_save_path_is_refused(run_copy, cli, hf_dir):
    before = snapshot(run_copy / "ckpt")
    code, _, err = cli("convert", "--from-hf", hf_dir, "--to", run_copy / "ckpt")
    assert code == 2 and "could no longer resume" in err
    assert snapshot(run_copy / "ckpt") == before and read_tracker(run_copy / "ckpt") == 2


def test_convert_into_a_foreign_directory_is_refused(run_copy, cli, hf_dir, tmp_path):
    other = tmp_path / "docs"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    code, _, err = cli("convert", "--from", run_copy / "ckpt", "--to-hf", other)
    assert code == 2 and "already holds other files" in err and (other / "notes.txt").read_text() == "keep me"


def test_convert_failing_mid_write_keeps_the_previous_output(run_copy, cli, hf_dir, monkeypatch):
    from lmforge.models import hf_io

    before = snapshot(hf_dir)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(hf_dir / "model.safetensors"))

    monkeypatch.setattr(hf_io, "write_sharded", disk_full)
    code, _, err = cli("convert", "--from", run_copy / "ckpt", "--to-hf", hf_dir)
    assert code == 2 and "the disk is full" in err and "Traceback" not in err
    assert snapshot(hf_dir) == before
    _no_temporaries(hf_dir.parent)


def test_convert_reimport_replaces_its_own_earlier_output(run_copy, cli, hf_dir, tmp_path):
    for _ in range(2):
        code, _, err = cli("convert", "--from-hf", hf_dir, "--to", tmp_path / "imported")
        assert code == 0, err
    assert read_tracker(tmp_path / "imported") == 0


# -- checkpoint saves: a fault at every write and rename ----------------------------------------


@pytest.fixture
def resumed(run_copy):
    from lmforge.config import load_config
    from lmforge.train.builder import build_trainer

    cfg = load_config(str(run_copy / "train.yaml"), [f"checkpoint.load_path={run_copy / 'ckpt'}"])
    trainer = build_trainer(cfg)
    trainer.resumption.resume_or_start()
    return trainer


def _assert_resumable(run, step):
    header = resolve_checkpoint(run / "ckpt")
    assert header is not None and header.global_step == step
    from lmforge.config import load_config
    from lmforge.train.builder import build_trainer

    cfg = load_config(str(run / "train.yaml"), [f"checkpoint.load_path={run / 'ckpt'}"])
    trainer = build_trainer(cfg)
    trainer.resumption.resume_or_start()
    assert trainer.state.global_step == step


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _after_dcp_wrote(real):
    def save(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    return save


FAULTS = {
    "common.json": ("_write_json", lambda real: _disk_full),
    "config.yaml": ("_write_yaml", lambda real: _disk_full),
    "dcp-shards": ("dcp.save", _after_dcp_wrote),
    "fsync": ("_fsync_tree", lambda real: _disk_full),
    "rename": ("replace_dir", lambda real: _disk_full),
    "tracker": ("write_tracker", lambda real: _disk_full),
}


@pytest.mark.parametrize("where", list(FAULTS))
def test_fault_at_each_write_of_a_save_keeps_the_previous_checkpoint(run_copy, resumed, monkeypatch, where):
    before = snapshot(run_copy / "ckpt" / ITER)
    name, make = FAULTS[where]
    owner, attr = (ckpt_mod.dcp, "save") if name == "dcp.save" else (ckpt_mod, name)
    monkeypatch.setattr(owner, attr, make(getattr(owner, attr)))
    manager = CheckpointManager(run_copy / "ckpt", config_dict={"model": {}})
    with pytest.raises(CheckpointError, match=r"No space left on device.*iteration 2\) is intact"):
        manager.save(resumed.checkpointable(), 4)
    monkeypatch.undo()
    assert read_tracker(run_copy / "ckpt") == 2 and snapshot(run_copy / "ckpt" / ITER) == before
    _assert_resumable(run_copy, 2)


class Crash(BaseException):
    """Stands for the process dying (nothing after it runs, no cleanup)."""


@pytest.mark.parametrize("at_rename", [1, 2])
def test_crash_during_a_resave_leaves_a_resumable_latest_checkpoint(
    run_copy, resumed, monkeypatch, at_rename
):
    calls = []

    class Os:
        def __getattr__(self, name):
            return getattr(os, name)

        def replace(self, src, dst):
            calls.append((src, dst))
            if len(calls) == at_rename:
                raise Crash
            return os.replace(src, dst)

    monkeypatch.setattr(atomic_mod, "os", Os())
    with pytest.raises(Crash):
        CheckpointManager(run_copy / "ckpt").save(resumed.checkpointable(), 2)  # iteration 2 again
    monkeypatch.undo()
    assert read_tracker(run_copy / "ckpt") == 2
    _assert_resumable(run_copy, 2)
    assert (run_copy / "ckpt" / ITER / ".metadata").is_file()


# -- concurrent runs --------------------------------------------------------------------------------


class Holder:
    """Another process holding the run lock of a directory."""

    def __init__(self, path: Path) -> None:
        code = (
            "import time; from lmforge.utils.run_lock import RunLock; "
            f"RunLock({str(path)!r}).acquire(); print('held', flush=True); time.sleep(60)"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "held"

    def __enter__(self):
        return self.proc.pid

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize("locked", ["ckpt", "run"], ids=["save_path", "output_dir"])
def test_second_run_on_a_directory_in_use_is_refused(run_copy, cli, locked):
    with Holder(run_copy / locked) as pid:
        before = snapshot(run_copy)
        code, _, err = cli(
            "train",
            "--config",
            run_copy / "train.yaml",
            "--set",
            f"checkpoint.load_path={run_copy / 'ckpt'}",
            "--set",
            "training.steps=4",
        )
        assert code == 2 and f"pid {pid} on host" in err and "in use by another lmforge run" in err
        assert ("checkpoint.save_path" if locked == "ckpt" else "output_dir") in err
        assert snapshot(run_copy) == before


def test_a_stale_lock_is_taken_over(run_copy, cli):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (run_copy / "ckpt" / LOCK_FILE).write_text(
        json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename})
    )
    code, _, err = cli(
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        f"checkpoint.load_path={run_copy / 'ckpt'}",
        "--set",
        "training.steps=3",
    )
    assert code == 0, err
    assert read_tracker(run_copy / "ckpt") == 3 and not (run_copy / "ckpt" / LOCK_FILE).exists()


def test_metrics_rewrite_failure_keeps_the_old_file(run_copy, cli, monkeypatch):
    from lmforge.train.callbacks import metrics

    before = (run_copy / "run" / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(
        metrics,
        "write_text_atomic",
        lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")),
    )
    code, _, err = cli(
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        f"checkpoint.load_path={run_copy / 'ckpt'}",
        "--set",
        "training.steps=3",
    )
    assert code == 2 and "read-only" in err
    assert (run_copy / "run" / "metrics.jsonl").read_bytes() == before and read_tracker(
        run_copy / "ckpt"
    ) == 2


# -- signals ----------------------------------------------------------------------------------------


def _env():
    path = os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """One process, three tiny runs (5 steps, saves every 2), each sent SIGTERM at one phase."""
    root = tmp_path_factory.mktemp("signals")
    proc = subprocess.run(
        [sys.executable, "-m", "end_to_end.adversarial.signal_run", "begin,step,final-save", str(root), "5"],
        cwd=REPO / "tests",
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return root, proc


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "expected"),
    # A stop requested before the first step saves the state at step 0 (a complete checkpoint).
    [("begin", 0), ("step", 3), ("final-save", 5)],
)
def test_sigterm_at_any_phase_exits_0_with_a_complete_checkpoint(signalled, phase, expected):
    root, proc = signalled
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{phase}: received SIGTERM" in proc.stdout
    assert read_tracker(root / phase / "ckpt") == expected
    assert resolve_checkpoint(root / phase / "ckpt").global_step == expected


@pytest.mark.slow
def test_sigterm_while_the_model_is_built_exits_0_with_a_checkpoint(run_copy):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "end_to_end.adversarial.signal_run",
            "build",
            str(run_copy / "train.yaml"),
            "2",
        ],
        cwd=REPO / "tests",
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "during start-up" in proc.stderr
    assert read_tracker(run_copy / "ckpt") == 0
    assert (run_copy / "ckpt" / "iteration_00000000" / ".metadata").is_file()
    assert (run_copy / "ckpt" / ITER / ".metadata").is_file()  # the earlier checkpoint is kept


def test_checkpointable_is_the_trainers(resumed):
    assert isinstance(resumed.checkpointable(), Checkpointable)


def test_async_save_stays_in_the_background_and_publishes_on_wait(run_copy, resumed):
    """The error handling around a save must not turn an asynchronous save into a blocking one."""
    manager = CheckpointManager(run_copy / "ckpt", async_save=True)
    assert manager.save(resumed.checkpointable(), 4)
    assert manager._pending is not None and manager._pending.future is not None
    manager.wait()
    assert read_tracker(run_copy / "ckpt") == 4
    assert resolve_checkpoint(run_copy / "ckpt").global_step == 4
