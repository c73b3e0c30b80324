"""Class 1: no file lmforge reads runs code (checkpoints, state skeletons, HF dirs, YAML callbacks)."""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import manager as ckpt_mod
from lmforge.train.checkpoint import state_codec
from lmforge.train.checkpoint.safe_load import (
    UnsafeFileError,
    decode_skeleton,
    encode_skeleton,
    read_dcp_metadata,
)

from .conftest import payload_pickle, rerecord_checksums, snapshot

ITER = "iteration_00000002"


def _poison_metadata(run, marker, func=None):
    (run / "ckpt" / ITER / ".metadata").write_bytes(payload_pickle(marker, func))
    # With its checksum updated too: the unpickler must refuse it on its own (checksums catch only
    # damage, not an attacker who rewrites the record).
    rerecord_checksums(run / "ckpt" / ITER)


def _refused(code, err, marker):
    assert code == 2, err
    assert "could run code" in err and "Traceback" not in err
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize(
    "func", [None, os.system, subprocess.call, eval], ids=["open", "os.system", "subprocess", "eval"]
)
def test_metadata_payload_refused_by_inspect(run_copy, cli, tmp_path, func):
    marker = tmp_path / "pwned"
    _poison_metadata(run_copy, marker, func)
    before = snapshot(run_copy)
    code, _, err = cli("checkpoint", "inspect", run_copy / "ckpt")
    _refused(code, err, marker)
    assert "torch.distributed.checkpoint" in err and snapshot(run_copy) == before


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--checkpoint", "{ckpt}", "--prompt", "t1 t2", "--max-new-tokens", "2"],
        ["eval", "--checkpoint", "{ckpt}", "--config", "{cfg}", "--eval-steps", "1"],
        ["train", "--config", "{cfg}", "--set", "checkpoint.load_path={ckpt}", "--set", "training.steps=3"],
        ["convert", "--from", "{ckpt}", "--to-hf", "{out}"],
    ],
    ids=["generate", "eval", "train-resume", "convert"],
)
def test_metadata_payload_refused_by_every_command(run_copy, cli, tmp_path, command):
    marker = tmp_path / "pwned"
    _poison_metadata(run_copy, marker)
    before = snapshot(run_copy / "ckpt")
    fill = {"ckpt": run_copy / "ckpt", "cfg": run_copy / "train.yaml", "out": tmp_path / "hf"}
    code, _, err = cli(*[a.format(**fill) for a in command])
    _refused(code, err, marker)
    assert snapshot(run_copy / "ckpt") == before and not (tmp_path / "hf").exists()


def test_metadata_pickle_naming_a_non_class_of_the_dcp_module_is_refused(tmp_path):
    # A module attribute that is not one of the format's classes (a function) is not admitted.
    marker = tmp_path / "pwned"
    data = pickle.dumps(payload_pickle(marker))  # any payload; then one naming the module's `os`
    crafted = b"\x80\x04ctorch.distributed.checkpoint.metadata\nfield\n)R."
    (tmp_path / ".metadata").write_bytes(crafted)
    with pytest.raises(UnsafeFileError, match="metadata.field"):
        read_dcp_metadata(tmp_path)
    assert data and not marker.exists()


def _save_with_skeleton(run, monkeypatch, dst, fake_encode):
    """Re-save the trained checkpoint into ``dst`` with skeletons produced by ``fake_encode``."""
    from lmforge.config import load_config
    from lmforge.train.builder import build_trainer

    cfg = load_config(
        str(run / "train.yaml"), [f"checkpoint.load_path={run / 'ckpt'}", f"output_dir={dst}/run"]
    )
    trainer = build_trainer(cfg)
    trainer.resumption.resume_or_start()
    monkeypatch.setattr(state_codec, "encode_skeleton", fake_encode)
    manager = ckpt_mod.CheckpointManager(dst / "ckpt", config_dict=None)
    assert manager.save(trainer.checkpointable(), 2)
    monkeypatch.undo()
    return trainer


def test_trainer_state_skeleton_payload_refused_on_resume(run_copy, cli, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    _save_with_skeleton(run_copy, monkeypatch, tmp_path, lambda skeleton: payload_pickle(marker))
    before = snapshot(tmp_path / "ckpt")
    code, _, err = cli(
        "train", "--config", run_copy / "train.yaml", "--set", f"checkpoint.load_path={tmp_path / 'ckpt'}"
    )
    _refused(code, err, marker)
    assert "skeleton" in err and snapshot(tmp_path / "ckpt") == before
    code, _, err = cli("checkpoint", "inspect", tmp_path / "ckpt")
    _refused(code, err, marker)


def test_checkpoints_of_older_lmforge_with_pickled_skeletons_still_resume(run_copy, tmp_path, monkeypatch):
    """The previous format pickled the skeleton; it loads through the restricted unpickler, exactly."""
    from lmforge.config import load_config
    from lmforge.train.builder import build_trainer
    from lmforge.train.checkpoint.safe_load import TensorRef

    def legacy_encode(skeleton):  # what lmforge wrote before: its marker class, pickled
        names = TensorRef.__module__, TensorRef.__qualname__
        TensorRef.__module__, TensorRef.__qualname__ = "lmforge.train.checkpoint", "_TensorRef"
        try:
            return pickle.dumps(skeleton)
        finally:
            TensorRef.__module__, TensorRef.__qualname__ = names

    saved = _save_with_skeleton(run_copy, monkeypatch, tmp_path, legacy_encode)
    cfg = load_config(str(run_copy / "train.yaml"), [f"checkpoint.load_path={tmp_path / 'ckpt'}"])
    resumed = build_trainer(cfg)
    resumed.resumption.resume_or_start()
    assert resumed.state.global_step == 2 and resumed.state.to_dict() == saved.state.to_dict()
    a, b = saved.optimizer.state_dict(), resumed.optimizer.state_dict()
    for p in a["state"]:
        for k, v in a["state"][p].items():
            assert torch.equal(v, b["state"][p][k]) if torch.is_tensor(v) else v == b["state"][p][k]


def test_optimizer_item_pickle_payload_refused(run_copy, tmp_path, monkeypatch, cli):
    """DCP stores non-tensor items with torch.save; they are read with weights_only=True."""
    marker = tmp_path / "pwned"
    real = ckpt_mod._optimizer_state_dict

    def evil(model, optimizer):
        form, sd = real(model, optimizer)
        payload = __import__("end_to_end.adversarial.conftest").adversarial.conftest.Payload(marker)
        if "param_groups" in sd:  # the nested form
            sd["param_groups"][0]["lr"] = payload
        else:  # torch's flattened form: group settings per parameter name
            sd[next(k for k in sd if k.startswith("param_groups.") and k.endswith(".lr"))] = payload
        return form, sd

    monkeypatch.setattr(ckpt_mod, "_optimizer_state_dict", evil)
    _save_with_skeleton(run_copy, monkeypatch, tmp_path, state_codec.encode_skeleton)
    code, _, err = cli(
        "train", "--config", run_copy / "train.yaml", "--set", f"checkpoint.load_path={tmp_path / 'ckpt'}"
    )
    _refused(code, err, marker)


@pytest.mark.parametrize(
    "value",
    [
        {1: (2.5, float("nan"), None), "a": [b"x", True, -3]},
        {"numpy": ("MT19937", __import__("numpy").arange(5, dtype="uint32"), 3, 0, 0.0)},
        [float("inf"), float("-inf"), torch.float32, {(1, 2): "tuple key"}],
    ],
    ids=["containers", "numpy-rng", "floats-dtypes"],
)
def test_json_skeleton_round_trips_exactly(value):
    back = decode_skeleton(encode_skeleton(value))
    assert repr(back) == repr(value)


@pytest.mark.parametrize(
    "func", [None, os.system, exec, getattr], ids=["open", "os.system", "exec", "getattr"]
)
def test_skeleton_payload_refused(tmp_path, func):
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeFileError, match="could run code"):
        decode_skeleton(payload_pickle(marker, func))
    assert not marker.exists()


def test_garbage_skeleton_is_a_clear_error():
    with pytest.raises(CheckpointError, match="corrupt"):
        decode_skeleton(b"lmforge-json/1\n{not json")


def _hf_dir(run, tmp_path, cli):
    hf = tmp_path / "hf"
    code, _, err = cli("convert", "--from", run / "ckpt", "--to-hf", hf)
    assert code == 0, err
    return hf


def test_hf_directory_with_pickled_weights_only_is_refused(run_copy, tmp_path, cli):
    marker = tmp_path / "pwned"
    hf = _hf_dir(run_copy, tmp_path, cli)
    for f in [*hf.glob("*.safetensors"), *hf.glob("*.safetensors.index.json")]:
        f.unlink()
    (hf / "pytorch_model.bin").write_bytes(payload_pickle(marker))
    before = snapshot(hf)
    code, _, err = cli(
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        f"checkpoint.load_path={hf}",
        "--set",
        "checkpoint.no_load_optim=true",
    )
    assert code == 2 and "safetensors format only" in err and not marker.exists()
    code, _, err = cli("convert", "--from-hf", hf, "--to", tmp_path / "imported")
    assert code == 2 and "safetensors" in err and not marker.exists()
    assert snapshot(hf) == before


def test_yaml_callback_import_path_needs_opt_in(run_copy, tmp_path, cli, monkeypatch):
    marker = tmp_path / "pwned"
    (tmp_path / "evil_cb.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass CB:\n    def on_step_end(self, *a, **k): pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("LMFORGE_ALLOW_IMPORTS", raising=False)
    text = (run_copy / "train.yaml").read_text() + "callbacks:\n- type: evil_cb:CB\n"
    (run_copy / "train.yaml").write_text(text)
    code, _, err = cli("train", "--config", run_copy / "train.yaml", "--set", "training.steps=1")
    assert code == 2 and "--allow-imports" in err and not marker.exists()
    code, _, err = cli("check", run_copy / "train.yaml")
    assert not marker.exists()
    # The person running the command opts in: now the module is imported (and its code runs).
    code, _, err = cli(
        "--allow-imports",
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        "training.steps=1",
        "--set",
        f"checkpoint.save_path={tmp_path / 'c2'}",
        "--set",
        f"output_dir={tmp_path / 'o2'}",
    )
    assert code == 0, err
    assert marker.exists()
