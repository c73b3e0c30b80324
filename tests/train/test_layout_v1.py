"""Checkpoints written before the shard-clean fused layout (weight layout 1) still load and resume exactly.

The fixtures (``tests/fixtures/layout_v1``, written by ``make_fixture.py`` with the code of that time) hold a
tiny model and its AdamW state after one step, the logits there and after one more step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import validate_section
from lmforge.models import build_model
from lmforge.models.common.fused_layout import WEIGHT_LAYOUT, gate_up_rows, per_head_rows, qkv_rows
from lmforge.train.checkpoint import Checkpointable, CheckpointManager, load_checkpoint, resolve_checkpoint

FIXTURES = Path(__file__).parents[1] / "fixtures" / "layout_v1"


def _fixture_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURES / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_layout_1_checkpoint_loads_converted_and_resumes_exactly(family, caplog):
    fixture = _fixture_module()
    expected = load_file(str(FIXTURES / family / "expected.safetensors"))
    torch.manual_seed(1)  # a different init: everything must come from the checkpoint
    model = build_model(validate_section("model", fixture.SECTIONS[family]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    header = resolve_checkpoint(FIXTURES / family)
    # Written before common.json recorded the layout: format lmforge-dcp/1 without the key means layout 1.
    assert "weight_layout" not in json.loads((header.path / "common.json").read_text())
    assert header.common["format"] == "lmforge-dcp/1" and header.common["weight_layout"] == 1
    with caplog.at_level(logging.INFO, logger="lmforge.train.checkpoint"):
        load_checkpoint(header, Checkpointable(model=model, optimizer=opt), no_load_optim=False)
    assert "layout 1" in caplog.text and f"converted to layout {WEIGHT_LAYOUT}" in caplog.text
    # The detection names the older formats it found and when their support ends (train/checkpoint/compat).
    assert (
        "written by an earlier lmforge (fused weight layout 1; no optimizer_type in common.json)"
        in caplog.text
    )
    assert "which is removed in lmforge 0.3" in caplog.text
    ids, labels = expected["input_ids"], expected["labels"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected["logits_at_checkpoint"], atol=1e-5, rtol=0)
    fixture.step(model, opt, ids, labels)  # the AdamW moments were converted too
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected["logits_after_step"], atol=1e-5, rtol=0)


def test_new_checkpoints_record_the_layout_and_load_unchanged(tmp_path):
    fixture = _fixture_module()
    torch.manual_seed(0)
    model = build_model(validate_section("model", fixture.SECTIONS["llama"]))
    CheckpointManager(tmp_path, save_max=1).save(Checkpointable(model=model), 1)
    header = resolve_checkpoint(tmp_path)
    assert header.common["weight_layout"] == WEIGHT_LAYOUT
    twin = build_model(validate_section("model", fixture.SECTIONS["llama"]))
    load_checkpoint(header, Checkpointable(model=twin), no_load_optim=True)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_unknown_future_layout_is_refused(tmp_path):
    fixture = _fixture_module()
    model = build_model(validate_section("model", fixture.SECTIONS["llama"]))
    CheckpointManager(tmp_path, save_max=1).save(Checkpointable(model=model), 1)
    common = tmp_path / "iteration_00000001" / "common.json"
    data = json.loads(common.read_text())
    data["weight_layout"] = WEIGHT_LAYOUT + 1
    common.write_text(json.dumps(data))
    from lmforge.errors import CheckpointError

    with pytest.raises(CheckpointError, match="weight_layout"):
        load_checkpoint(resolve_checkpoint(tmp_path), Checkpointable(model=model), no_load_optim=True)


def test_layout_maps_are_permutations_into_the_documented_order():
    # GQA: 4 heads in 2 groups of head_dim 1: [q0 q1 k0 v0 | q2 q3 k1 v1] from [q0 q1 q2 q3 k0 k1 v0 v1].
    assert qkv_rows(4, 2, 1).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert gate_up_rows(3).tolist() == [0, 3, 1, 4, 2, 5]
    assert per_head_rows(2, 2, 1).tolist() == [0, 1, 4, 2, 3, 5]
