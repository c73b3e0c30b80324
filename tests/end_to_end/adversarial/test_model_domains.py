"""``check`` refuses every model dimension and numeric value that ``train`` crashes on or trains as NaN,
naming the key (exit 2), before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DENSE = REPO / "configs" / "demo.yaml"  # qwen3: GQA, head_dim 32
MLA_MOE = REPO / "configs" / "muon_deepseek_v3.yaml"  # deepseek_v3: MLA, 8 routed experts

CASES = {
    "hidden not divisible, head_dim unset": (DENSE, ["model.hidden_size=30", "model.head_dim=null"], "model.hidden_size = 30 is not divisible by model.num_attention_heads = 4"),
    # 0 is a value the user wrote, not "unset": it is refused, never replaced by the derived default.
    "head_dim 0": (DENSE, ["model.head_dim=0"], "model.head_dim = 0 must be a positive integer"),
    "num_key_value_heads 0": (DENSE, ["model.num_key_value_heads=0"], "model.num_key_value_heads = 0 must be a positive integer"),
    "n_group 0": (MLA_MOE, ["model.n_group=0"], "model.n_group = 0 must be a positive integer"),
    "topk_group 0": (MLA_MOE, ["model.topk_group=0"], "model.topk_group = 0 must be a positive integer"),
    "odd head_dim": (DENSE, ["model.head_dim=15"], "model.head_dim = 15 must be even"),
    "odd derived head_dim": (DENSE, ["model.hidden_size=20", "model.head_dim=null"], "model.head_dim = 5 (model.hidden_size / model.num_attention_heads) must be even"),
    "rope_theta 0": (DENSE, ["model.rope_theta=0"], "model.rope_theta = 0.0 must be a finite number > 0"),
    "rope_theta negative": (DENSE, ["model.rope_theta=-10000"], "model.rope_theta = -10000.0 must be a finite number > 0"),
    "rope_theta nan": (DENSE, ["model.rope_theta=.nan"], "model.rope_theta = nan"),
    "rms_norm_eps inf": (DENSE, ["model.rms_norm_eps=.inf"], "model.rms_norm_eps = inf must be a finite number > 0"),
    "rope scaling factor 0": (DENSE, ["model.rope_scaling={rope_type: linear, factor: 0}"], "model.rope_scaling.factor = 0"),
    "odd qk_rope_head_dim": (MLA_MOE, ["model.qk_rope_head_dim=63"], "model.qk_rope_head_dim = 63 must be a positive even number"),
    "routed_scaling_factor 0": (MLA_MOE, ["model.routed_scaling_factor=0"], "model.routed_scaling_factor = 0"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_check_refuses_a_model_value_train_cannot_use(cli, name):
    config, sets, needle = CASES[name]
    argv = ["check", "--config", config]
    for s in sets:
        argv += ["--set", s]
    code, _, err = cli(*argv)
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_the_shipped_values_still_pass(cli):
    for config in (DENSE, MLA_MOE):
        code, _, err = cli("check", "--config", config)
        assert code == 0, err
