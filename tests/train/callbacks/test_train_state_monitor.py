"""monitor.train_state: local / device gradient norms and losses equal independently computed ones."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.train.callbacks.monitor import TrainStateMonitorCallback
from lmforge.train.callbacks.monitor_hooks import norm_filters

from .helpers import TinyLM, drive, micro_batches


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected(model, step_index, micro):
    """Per-micro-batch gradients, computed separately with torch.autograd.grad."""
    params = dict(model.named_parameters())
    per_micro, losses = [], []
    for batch in micro_batches(micro, seed=step_index):
        out = model(**batch)
        grads = torch.autograd.grad(out.loss / micro, list(params.values()))
        per_micro.append(dict(zip(params, grads)))
        losses.append(float(out.loss.detach()))
    return per_micro, losses


def test_local_and_device_norms_and_losses(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    section = {
        "local_norm": True,
        "device_norm": ["embedding", "output_layer"],
        "local_loss": True,
        "device_loss": True,
    }
    cb = TrainStateMonitorCallback(validate_section("monitor.train_state", section), tmp_path)
    expected = [_expected(model, s, 3) for s in range(2)]  # weights never change in drive()
    drive([cb], model, steps=2, micro=3)
    records = _records(cb.path)

    for step in (1, 2):
        per_micro, losses = expected[step - 1]
        local = [r for r in records if r.get("step") == step and "local_norm" in r]
        assert [r["micro_step"] for r in local] == [1, 2, 3]
        for rec, grads in zip(local, per_micro):
            assert set(rec["local_norm"]) == set(grads)  # True: every parameter
            for name, grad in grads.items():
                assert rec["local_norm"][name] == pytest.approx(float(grad.norm()), rel=1e-6, abs=1e-9)
        device = next(r["device_norm"] for r in records if r.get("step") == step and "device_norm" in r)
        assert set(device) == {"embedding.word_embeddings.weight", "output_layer.weight"}
        for name in device:
            total = sum(g[name] for g in per_micro)
            assert device[name] == pytest.approx(float(total.norm()), rel=1e-6)
        local_losses = [r["local_loss"] for r in records if r.get("step") == step and "local_loss" in r]
        assert local_losses == pytest.approx(losses, rel=1e-6)
        device_loss = next(r["device_loss"] for r in records if r.get("step") == step and "device_loss" in r)
        assert device_loss == pytest.approx(sum(losses) / 3, rel=1e-6)


def test_substring_selector_and_off(tmp_path):
    model = TinyLM()
    cb = TrainStateMonitorCallback(
        validate_section("monitor.train_state", {"local_norm": "decoder.layers.1"}), tmp_path
    )
    drive([cb], model, steps=1, micro=1)
    (rec,) = _records(cb.path)
    assert set(rec["local_norm"]) == {"decoder.layers.1.weight", "decoder.layers.1.bias"}

    off = TrainStateMonitorCallback(
        validate_section("monitor.train_state", {"local_norm": "", "device_norm": []}), tmp_path / "off"
    )
    drive([off], TinyLM(), steps=1, micro=1)
    assert not off.path.exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, []), (False, None), ("", None), ("emb", ["emb"]), (["a", ""], ["a"]), ([], None)],
)
def test_norm_filters(value, expected):
    assert norm_filters(value, "monitor.train_state.local_norm") == expected


def test_norm_filters_rejects_other_types():
    with pytest.raises(ConfigError, match="monitor.train_state.device_norm only supports bool, str, or list"):
        norm_filters(3, "monitor.train_state.device_norm")


def test_local_norms_under_fsdp2(tmp_path):
    """FSDP2 never runs tensor hooks on its sharded parameters; local norms still come out right."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = TinyLM()
        expected = _expected(plain, 0, 2)[0]
        sharded = TinyLM()
        sharded.load_state_dict(plain.state_dict())
        for layer in sharded.decoder.layers:
            fully_shard(layer)
        fully_shard(sharded)
        cb = TrainStateMonitorCallback(
            validate_section(
                "monitor.train_state", {"local_norm": "decoder.layers", "device_norm": "decoder.layers.0"}
            ),
            tmp_path,
        )
        drive([cb], sharded, steps=1, micro=2)
        records = _records(cb.path)
        local = [r for r in records if "local_norm" in r]
        assert [r["micro_step"] for r in local] == [1, 2]
        for rec, grads in zip(local, expected):
            assert set(rec["local_norm"]) == {n for n in grads if n.startswith("decoder.layers")}
            for name, value in rec["local_norm"].items():
                assert value == pytest.approx(float(grads[name].norm()), rel=1e-5)
        device = next(r["device_norm"] for r in records if "device_norm" in r)
        for name, value in device.items():
            assert value == pytest.approx(float((expected[0][name] + expected[1][name]).norm()), rel=1e-5)
    finally:
        dist.destroy_process_group()
