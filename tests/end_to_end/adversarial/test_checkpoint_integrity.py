"""Checkpoints are verified on load: damaged, incomplete or mismatched ones are refused (exit 2) naming
the file and what is wrong, before any step runs; nothing is defaulted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import Checkpointable, CheckpointManager, load_checkpoint, resolve_checkpoint
from lmforge.train.checkpoint.verify import CHECKSUM_FILE

from .conftest import snapshot

ITER = "iteration_00000002"


def _resume(cli, run: Path, *sets: str):
    argv = ["train", "--config", run / "train.yaml", "--set", f"checkpoint.load_path={run / 'ckpt'}"]
    for s in ("training.steps=3", *sets):
        argv += ["--set", s]
    return cli(*argv)


def _shard(run: Path) -> Path:
    return next((run / "ckpt" / ITER).glob("*.distcp"))


def _edit_common(run: Path, **changes) -> None:
    path = run / "ckpt" / ITER / "common.json"
    common = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            common.pop(key, None)
        else:
            common[key] = value
    path.write_text(json.dumps(common))


def _no_step_ran(run: Path) -> bool:
    metrics = run / "run" / "metrics.jsonl"
    return not metrics.exists() or all(
        json.loads(line)["step"] <= 2 for line in metrics.read_text().splitlines()
    )


@pytest.mark.slow
def test_a_checkpoint_records_a_checksum_of_every_file(run_copy):
    it = run_copy / "ckpt" / ITER
    record = json.loads((it / CHECKSUM_FILE).read_text())
    on_disk = {p.name for p in it.iterdir() if p.name != CHECKSUM_FILE}
    assert record["algorithm"] == "sha256" and set(record["files"]) == on_disk
    import hashlib

    shard = _shard(run_copy)
    want = record["files"][shard.name]
    assert want == {"size": shard.stat().st_size, "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    assert json.loads((it / "common.json").read_text())["format"] == "lmforge-dcp/3"


@pytest.mark.parametrize("where", ["middle", "end"])
def test_overwritten_shard_bytes_of_the_same_size_are_refused(run_copy, cli, where):
    shard = _shard(run_copy)
    data = bytearray(shard.read_bytes())
    at = len(data) // 2 if where == "middle" else len(data) - 8
    data[at : at + 8] = b"\xff" * 8  # NaN patterns in float32 weights, or damaged framing
    shard.write_bytes(bytes(data))
    before = snapshot(run_copy / "ckpt")
    code, _, err = _resume(cli, run_copy)
    assert code == 2
    assert (
        f"{shard.name} has other bytes than were written" in err
        and "damaged" in err
        and "Traceback" not in err
    )
    assert snapshot(run_copy / "ckpt") == before and _no_step_ran(run_copy)


def test_a_truncated_or_missing_shard_is_refused_naming_it(run_copy, cli):
    shard = _shard(run_copy)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and f"{shard.name} has {size - 100} bytes, {size} were written" in err
    shard.unlink()
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and f"{shard.name} is missing" in err


def test_missing_common_json_is_refused_not_defaulted(run_copy, cli):
    (run_copy / "ckpt" / ITER / "common.json").unlink()
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and "common.json is missing" in err and "Traceback" not in err
    # The weights-only tools refuse it too (they would otherwise assume a weight layout).
    code, _, err = cli(
        "generate", "--checkpoint", run_copy / "ckpt", "--prompt", "t1", "--max-new-tokens", "1"
    )
    assert code == 2 and "common.json is missing" in err


@pytest.mark.parametrize("value", [True, "abc", 2.0, None, 0, 7])
def test_weight_layout_must_be_an_exact_known_integer(run_copy, cli, value):
    _edit_common(run_copy, weight_layout=value)
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and "Traceback" not in err
    assert "weight_layout must be one of the integers [1, 2]" in err and repr(value) in err


def test_a_missing_weight_layout_in_a_new_format_checkpoint_is_refused(run_copy, cli):
    _edit_common(run_copy, weight_layout=...)
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and "weight_layout must be one of the integers" in err and "it is missing" in err


def test_an_edited_common_json_fails_its_checksum(run_copy, cli):
    path = run_copy / "ckpt" / ITER / "common.json"
    text = path.read_text()  # one digit changed: the same size, valid values, not what was written
    at = text.index('"consumed_samples": ') + len('"consumed_samples": ')
    path.write_text(text[:at] + ("1" if text[at] != "1" else "2") + text[at + 1 :])
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and "common.json has other bytes than were written" in err


def test_a_deleted_checksum_record_is_refused(run_copy, cli):
    (run_copy / "ckpt" / ITER / CHECKSUM_FILE).unlink()
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and f"{CHECKSUM_FILE} is missing" in err


def test_a_shape_mismatch_is_refused_naming_the_parameter(run_copy, cli):
    code, _, err = _resume(cli, run_copy, "model.intermediate_size=48", "checkpoint.no_load_optim=true")
    assert code == 2 and "does not match the model's shapes" in err and "linear_fc" in err


def _with_optimizer(run: Path, optimizer: dict) -> None:
    raw = yaml.safe_load((run / "train.yaml").read_text())
    raw["optimizer"] = optimizer
    (run / "train.yaml").write_text(yaml.safe_dump(raw))


LION = {"type": "Lion", "betas": [0.9, 0.99], "weight_decay": 0.01}


def test_resuming_with_another_optimizer_type_is_refused_unless_reset(run_copy, cli):
    _with_optimizer(run_copy, LION)
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and "holds the state of AdamW" in err and "optimizer is Lion" in err
    assert "checkpoint.reset_optimizer: true" in err and _no_step_ran(run_copy)
    code, _, err = _resume(cli, run_copy, "checkpoint.reset_optimizer=true")
    assert code == 0, err
    steps = [
        json.loads(line)["step"] for line in (run_copy / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 3  # resumed at step 2, trained step 3 with a fresh Lion state


def test_a_legacy_checkpoint_without_the_type_is_compared_by_its_state_names(run_copy, cli):
    # As written before common.json recorded the optimizer type (and before checksums existed).
    _edit_common(run_copy, optimizer_type=..., format="lmforge-dcp/1")
    (run_copy / "ckpt" / ITER / CHECKSUM_FILE).unlink()
    _with_optimizer(run_copy, LION)
    code, _, err = _resume(cli, run_copy)
    assert code == 2 and "an optimizer with other per-parameter states" in err and "optimizer is Lion" in err


def test_reset_optimizer_needs_something_to_resume(run_copy, cli):
    code, _, err = cli(
        "check", "--config", run_copy / "train.yaml", "--set", "checkpoint.reset_optimizer=true",
        "--set", "checkpoint.auto_resume=false",
    )  # fmt: skip
    assert code == 2 and "checkpoint.reset_optimizer" in err and "nothing to act on" in err
    code, _, err = cli(
        "check", "--config", run_copy / "train.yaml", "--set", "checkpoint.reset_optimizer=true",
        "--set", f"checkpoint.load_path={run_copy / 'ckpt'}", "--set", "checkpoint.no_load_optim=true",
    )  # fmt: skip
    assert code == 2 and "checkpoint.no_load_optim" in err


def test_an_asynchronous_save_records_checksums_that_verify(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, async_save=True)
    assert manager.save(Checkpointable(model, opt), 1)
    manager.close()
    record = json.loads((tmp_path / "iteration_00000001" / CHECKSUM_FILE).read_text())
    assert any(name.endswith(".distcp") for name in record["files"])
    twin = torch.nn.Linear(4, 3)
    load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(twin), no_load_optim=True)
    assert torch.equal(twin.weight, model.weight)
    shard = next((tmp_path / "iteration_00000001").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="other bytes than were written"):
        load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(twin), no_load_optim=True)
