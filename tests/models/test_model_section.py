"""The typed model section: validated once, read by attribute, one table of inert fields."""

from __future__ import annotations

import pytest

from lmforge.config import load_config, validate_section
from lmforge.config.inert import INERT_FIELDS, inert_fields
from lmforge.errors import ConfigError
from lmforge.models import build_model, build_model_config, families, registry
from lmforge.models.common.config_keys import MOE_MF_KEYS
from lmforge.models.common.section import FamilySection
from lmforge.train.builder import build_training_model

TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "architectures": "Qwen3MoeForCausalLM",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "compute_dtype": "float32",
}


def _without_layers() -> dict:
    return {k: v for k, v in TINY_QWEN3_MOE.items() if k != "num_hidden_layers"}


def test_the_section_is_typed_by_its_family_with_aliases_folded():
    typed = validate_section("model", {**_without_layers(), "num_layers": 3, "rotary_base": 5000}).typed
    assert isinstance(typed.section, FamilySection)
    assert type(typed.section).__name__ == "Qwen3MoeSection"
    assert typed.section.num_hidden_layers == 3 and typed.config.num_layers == 3
    assert typed.section.rope_theta == 5000.0 and typed.config.rope_theta == 5000.0
    assert typed.section.decoder_sparse_step == 1  # the family's default, filled in
    with pytest.raises(AttributeError):
        typed.section.n_routed_experts  # noqa: B018  (a deepseek_v3 key: not a field of qwen3_moe)


def test_builders_refuse_anything_but_the_validated_section():
    for call in (build_model, build_model_config):
        with pytest.raises(TypeError, match=r"validate_section\('model', mapping\)"):
            call(dict(TINY_QWEN3_MOE))
    with pytest.raises(TypeError, match="got TrainingConfig"):
        build_model(validate_section("training", {}))
    with pytest.raises(TypeError, match="got dict"):
        build_training_model(dict(TINY_QWEN3_MOE), seed=0, device="cpu")


def test_the_builder_validates_nothing_again(monkeypatch):
    section = validate_section("model", TINY_QWEN3_MOE)

    def refuse(model_type):
        raise AssertionError("the model section was validated again")

    # Every validation of a model section starts by finding its family.
    monkeypatch.setattr(registry, "family_for", refuse)
    model = build_model(section, device="meta")
    assert build_model_config(section) is section.typed.config
    assert model.config is section.typed.config


def test_type_errors_name_the_key_the_file_wrote():
    with pytest.raises(ConfigError, match=r"model\.num_layers = '3' has type str; expected int"):
        validate_section("model", {**_without_layers(), "num_layers": "3"})
    with pytest.raises(ConfigError, match=r"model\.norm_topk_prob = 1 has type int; expected bool"):
        validate_section("model", {**TINY_QWEN3_MOE, "norm_topk_prob": 1})


def test_model_inert_keys_come_from_the_one_table():
    model_inert = inert_fields("model")
    assert {"moe_grouped_gemm", "mla_qkv_concat", "use_pad_tokens", "ep_size"} <= set(model_inert)
    # The key tables describe those keys with the table's words, not words of their own.
    assert MOE_MF_KEYS["moe_grouped_gemm"][1] == f"no effect: {model_inert['moe_grouped_gemm']}"
    # Every one of them is a key some family accepts (so the table names nothing unreachable).
    accepted = {key for family in families().values() for key in family.keys.valid_keys()}
    assert set(model_inert) <= accepted


def test_model_inert_keys_warn_at_load(base_config):
    inert = {"moe_grouped_gemm": True, "use_pad_tokens": False}
    base_config["model"] = {**TINY_QWEN3_MOE, "seq_length": 32, **inert}  # the data's seq_length
    warnings = load_config(base_config).warnings
    why = INERT_FIELDS["model.moe_grouped_gemm"]
    assert f"model.moe_grouped_gemm = True has no effect in lmforge: {why}." in warnings
    assert any(w.startswith("model.use_pad_tokens = False has no effect") for w in warnings)
    assert not any("moe_router_fusion" in w for w in warnings)  # not written: nothing to say
