"""Checkpoint files: layout, rotation, atomicity under a crash, load rules and their errors."""

import json
import os
import shutil

import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import (
    Checkpointable,
    CheckpointManager,
    load_checkpoint,
    read_tracker,
    resolve_checkpoint,
)
from lmforge.train.checkpoint import manager as ckpt_mod
from lmforge.train.state import TrainState

from .tiny import TinyLM


def trained(seed=0):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 32, (2, 8)), labels=torch.randint(0, 32, (2, 8))).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def iterations(path):
    return sorted(p.name for p in path.iterdir() if p.name.startswith("iteration_"))


def test_layout_prefix_and_common_json(tmp_path):
    model, opt = trained()
    mgr = CheckpointManager(tmp_path, prefix="qwen3", save_max=3)
    assert mgr.save(Checkpointable(model, opt, state=TrainState(consumed_samples=40, global_batch_size=8)), 5)
    it = tmp_path / "iteration_00000005"
    assert sorted(os.listdir(it)) == [
        ".metadata",
        "checksums.json",
        "common.json",
        "qwen3-0000000-0000001_0.distcp",
    ]
    common = json.loads((it / "common.json").read_text())
    for key in (
        "epoch_num",
        "step_num",
        "global_step",
        "loss_scale",
        "global_batch_size",
        "consumed_samples",
        "ckpt_status",
    ):
        assert key in common
    assert common["global_step"] == 5 and common["consumed_samples"] == 40 and common["has_optimizer"]
    assert read_tracker(tmp_path) == 5


def test_save_max_rotates_only_this_runs_checkpoints(tmp_path, monkeypatch):
    messages = []
    monkeypatch.setattr(ckpt_mod.logger, "info", lambda msg, *args: messages.append(msg % args))
    model, opt = trained()
    old = CheckpointManager(tmp_path, save_max=5)
    old.save(Checkpointable(model, opt), 1)  # an earlier run's checkpoint
    mgr = CheckpointManager(tmp_path, save_max=2)
    for step in (10, 20, 30):
        mgr.save(Checkpointable(model, opt), step)
    assert iterations(tmp_path) == ["iteration_00000001", "iteration_00000020", "iteration_00000030"]
    removed = [m for m in messages if "more than 'keep_checkpoint_max': 2. So, the oldest directory:" in m]
    assert (
        len(removed) == 1 and "iteration_00000010" in removed[0] and removed[0].endswith("will be removed!")
    )
    assert read_tracker(tmp_path) == 30


def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model, opt = trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(Checkpointable(model, opt), 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(*args, **kwargs):  # dies after DCP has written part of the new checkpoint
        real_save(*args, **kwargs)
        raise OSError("simulated crash: disk gone")

    real_save = ckpt_mod.dcp.save
    monkeypatch.setattr(ckpt_mod.dcp, "save", crash)
    with pytest.raises(
        CheckpointError, match=r"simulated crash: disk gone.*previous checkpoint \(iteration 2\) is intact"
    ):
        mgr.save(Checkpointable(model, opt), 4)
    monkeypatch.undo()
    assert read_tracker(tmp_path) == 2 and iterations(tmp_path) == ["iteration_00000002"]
    fresh, fresh_opt = trained(seed=1)
    load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(fresh, fresh_opt), no_load_optim=False)
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    # The next save cleans the leftover partial directory and publishes normally.
    CheckpointManager(tmp_path).save(Checkpointable(model, opt), 4)
    assert read_tracker(tmp_path) == 4 and not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_crash_between_rename_and_tracker_keeps_tracker_on_previous(tmp_path, monkeypatch):
    model, opt = trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(Checkpointable(model, opt), 2)
    monkeypatch.setattr(ckpt_mod, "write_tracker", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(CheckpointError, match="crash.*iteration 2"):
        mgr.save(Checkpointable(model, opt), 4)
    assert read_tracker(tmp_path) == 2
    assert resolve_checkpoint(tmp_path).path.name == "iteration_00000002"


def test_refuses_to_save_non_finite_weights(tmp_path):
    model, opt = trained()
    with torch.no_grad():
        model.hidden.weight[0, 0] = float("nan")
    assert not CheckpointManager(tmp_path).save(Checkpointable(model, opt), 3)
    assert read_tracker(tmp_path) is None and iterations(tmp_path) == []


def test_no_save_optim_then_resume_is_a_clear_error_and_weights_only_works(tmp_path):
    model, opt = trained()
    CheckpointManager(tmp_path, no_save_optim=True).save(Checkpointable(model, opt), 3)
    fresh, fresh_opt = trained(seed=1)
    with pytest.raises(CheckpointError, match="no_load_optim is False but no optimizer checkpoint found in"):
        load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(fresh, fresh_opt), no_load_optim=False)
    state = TrainState()
    load_checkpoint(
        resolve_checkpoint(tmp_path), Checkpointable(fresh, fresh_opt, state=state), no_load_optim=True
    )
    assert state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_hf_directory_needs_no_load_optim(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    header = resolve_checkpoint(tmp_path)
    assert header.kind == "hf"
    model, opt = trained()
    with pytest.raises(
        CheckpointError, match=r"Resume training \(no_load_optim=False\) is not supported for HuggingFace"
    ):
        load_checkpoint(header, Checkpointable(model, opt), no_load_optim=False)
    calls = []
    load_checkpoint(
        header, Checkpointable(model, opt), no_load_optim=True, hf_loader=lambda m, p: calls.append(p)
    )
    assert calls == [tmp_path]


def test_missing_or_empty_load_path_resolve_to_nothing_and_junk_is_an_error(tmp_path):
    # Nothing there: None, for the caller to refuse in its own terms (train: tests/end_to_end/adversarial/test_resume_pattern.py).
    assert resolve_checkpoint("") is None and resolve_checkpoint(tmp_path / "nope") is None
    (tmp_path / ".lmforge.lock").write_text("{}")  # a run lock is not a checkpoint
    assert resolve_checkpoint(tmp_path) is None
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        resolve_checkpoint(tmp_path)


def test_shape_mismatch_names_the_parameter(tmp_path):
    model, opt = trained()
    CheckpointManager(tmp_path).save(Checkpointable(model, opt), 1)
    other = TinyLM(hidden=8)
    with pytest.raises(CheckpointError, match="hidden.weight"):
        load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(other), no_load_optim=True)


def test_resave_of_existing_step_replaces_it(tmp_path):
    model, opt = trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(Checkpointable(model, opt), 1)
    with torch.no_grad():
        model.hidden.bias.add_(1)
    mgr.save(Checkpointable(model, opt), 1)
    fresh, _ = trained(seed=3)
    load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(fresh), no_load_optim=True)
    assert torch.equal(fresh.hidden.bias, model.hidden.bias)
    shutil.rmtree(tmp_path)


def test_optimizer_is_saved_flat_and_the_previous_nested_form_still_loads(tmp_path, monkeypatch):
    """New checkpoints keep param-group settings per parameter name ("fqn_flat": pipeline stages group
    their parameters differently); checkpoints of the nested form ("fqn") written before still resume."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = trained()
    opt.param_groups[0]["lr"] = 3e-3  # a group setting the fresh optimizer below does not have
    mgr = CheckpointManager(tmp_path / "flat", save_max=3)
    assert mgr.save(Checkpointable(model, opt, state=TrainState()), 1)
    common = json.loads((tmp_path / "flat" / "iteration_00000001" / "common.json").read_text())
    assert common["optimizer_format"] == "fqn_flat"

    def nested(model, optimizer):  # what save wrote before the flat form
        return "fqn", get_optimizer_state_dict(model, optimizer)

    monkeypatch.setattr(ckpt_mod, "_optimizer_state_dict", nested)
    assert CheckpointManager(tmp_path / "nested", save_max=3).save(
        Checkpointable(model, opt, state=TrainState()), 1
    )
    monkeypatch.undo()
    for kind in ("flat", "nested"):
        other, other_opt = trained(seed=1)
        load_checkpoint(
            resolve_checkpoint(tmp_path / kind),
            Checkpointable(other, other_opt, state=TrainState()),
            no_load_optim=False,
        )
        for p, q in zip(model.parameters(), other.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(other_opt.state[q][key], opt.state[p][key], rtol=0, atol=0)
        assert other_opt.param_groups[0]["lr"] == 3e-3
