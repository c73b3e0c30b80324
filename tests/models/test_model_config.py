"""The model section: registry, key validation, the spec's and the original's YAML model sections."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.models import build_model, build_model_config
from lmforge.models.registry import resolve

# shared/ lies beside the checkout (here and in CI); /work/shared is the development layout.
REFERENCE_YAMLS = next(
    (
        root / "reference" / "mindformers-yamls"
        for root in (Path(__file__).resolve().parents[3] / "shared", Path("/work/shared"))
        if (root / "reference" / "mindformers-yamls").is_dir()
    ),
    Path("/work/shared/reference/mindformers-yamls"),
)

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": "LlamaForCausalLM",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "compute_dtype": "float32",
}


def test_unknown_model_type_lists_known_types():
    with pytest.raises(ConfigError) as e:
        build_model_config(validate_section("model", {"model_type": "gpt5", "architectures": "X"}))
    msg = str(e.value)
    assert "model.model_type" in msg and "'gpt5'" in msg
    for name in ("llama", "qwen3", "qwen3_moe", "deepseek_v3"):
        assert name in msg


def test_missing_model_type_and_architectures_are_errors():
    with pytest.raises(ConfigError, match=r"model\.model_type is required"):
        build_model_config(validate_section("model", {"architectures": "LlamaForCausalLM"}))
    with pytest.raises(ConfigError, match=r"model\.architectures is required.*LlamaForCausalLM"):
        build_model_config(validate_section("model", {"model_type": "llama"}))


def test_architecture_must_match_model_type():
    with pytest.raises(ConfigError, match=r"does not match model\.model_type = 'llama'.*LlamaForCausalLM"):
        build_model_config(validate_section("model", {**TINY_LLAMA, "architectures": "Qwen3ForCausalLM"}))
    with pytest.raises(ConfigError, match="not a known architecture"):
        build_model_config(validate_section("model", {**TINY_LLAMA, "architectures": "GPT2LMHeadModel"}))
    # The model section takes a string (the original's type check refuses a list); a Hugging Face
    # config.json's list (first element) is taken by the registry that imports it.
    with pytest.raises(ConfigError, match=r"model\.architectures must be a string"):
        validate_section("model", {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]})
    assert resolve({**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}).config.model_type == "llama"


def test_typo_in_structure_key_is_an_error_with_suggestion():
    section = dict(TINY_LLAMA)
    section["num_hiden_layers"] = 3
    with pytest.raises(ConfigError) as e:
        build_model_config(validate_section("model", section))
    msg = str(e.value)
    assert "model.num_hiden_layers" in msg
    assert "Did you mean 'num_hidden_layers'?" in msg
    assert "intermediate_size" in msg  # lists the valid keys


def test_key_of_another_family_is_rejected():
    # MoE keys do not belong to a dense Llama.
    with pytest.raises(ConfigError, match=r"model\.n_routed_experts"):
        build_model_config(validate_section("model", {**TINY_LLAMA, "n_routed_experts": 8}))


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("hidden_size", "64", "expected int"),
        ("rms_norm_eps", "1e-6", "write 1.e-6"),
        ("tie_word_embeddings", 1, "expected bool"),
        ("compute_dtype", "int8", "model.compute_dtype"),
        ("layernorm_compute_dtype", "bfloat16", "always computes this in float32"),
        ("hidden_act", "gelu", "model.hidden_act"),
        ("num_key_value_heads", 3, "must divide"),
        ("position_embedding_type", "alibi", "position_embedding_type"),
    ],
)
def test_bad_values_name_the_key(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        build_model_config(validate_section("model", {**TINY_LLAMA, key: value}))
    assert f"model.{key}" in str(e.value)


def test_alias_conflict_is_an_error():
    section = _tiny_ds3(scoring_func="sigmoid", moe_router_score_function="softmax")
    with pytest.raises(ConfigError, match="contradicts model.scoring_func"):
        build_model_config(validate_section("model", section))
    cfg = build_model_config(validate_section("model", _tiny_ds3(moe_router_topk_scaling_factor=1.5)))
    assert cfg.routed_scaling_factor == 1.5


def test_model_config_validates_without_building():
    # The run plan (lmforge check / train) types the model section this way, before anything is built.
    assert build_model_config(validate_section("model", TINY_LLAMA)).vocab_size == TINY_LLAMA["vocab_size"]
    with pytest.raises(ConfigError):
        build_model_config(validate_section("model", {**TINY_LLAMA, "vocab_size": 0}))


def _tiny_ds3(**overrides):
    section = {
        "model_type": "deepseek_v3",
        "architectures": "DeepseekV3ForCausalLM",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
        "compute_dtype": "float32",
    }
    section.update(overrides)
    return section


def _model_section(file_name: str) -> dict:
    return yaml.safe_load((REFERENCE_YAMLS / file_name).read_text())["model"]


SPEC_DS3 = "tests__st__test_multi_cards_cases__test_pynative__test_models__test_deepseek3__pynative_ds3.yaml"


def test_spec_deepseek_v3_section_builds_full_size_on_meta():
    section = _model_section(SPEC_DS3)
    model = build_model(validate_section("model", section), device="meta")
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.mtp_num_layers) == (12, 1792, 8, 1)
    assert cfg.compute_dtype == torch.bfloat16 and cfg.params_dtype == torch.float32
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40
    assert cfg.load_balancing_type == "seq_aux_loss" and cfg.aux_loss_coeff == 0.001
    assert cfg.moe_layers == tuple(range(1, 13))  # first_k_dense_replace: 1, and the MTP layer (id 12)
    assert all(p.device.type == "meta" for p in model.parameters())
    w = dict(model.named_parameters())
    assert w["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (8, 2 * 1024, 1792)
    assert w["decoder.layers.1.mlp.router.weight"].dtype == torch.float32
    assert w["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.bfloat16


def test_spec_deepseek_v3_section_scaled_down_trains_a_step():
    section = _model_section(SPEC_DS3)
    section.update(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        seq_length=16,
        compute_dtype="float32",
    )
    torch.manual_seed(0)
    model = build_model(validate_section("model", section))
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids, labels=ids.roll(-1, 1))
    assert set(out.aux_losses) == {"load_balancing_loss", "mtp_1_loss"}
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" not in n or "weight" in n)


@pytest.mark.parametrize(
    "file_name",
    [
        "tests__st__test_multi_cards_cases__test_pynative__test_models__test_deepseek3__pynarive_ds3@0fa8a0a68.yaml",
        "mindspore-ai_docs__docs__mindformers__docs__source_zh_cn__example__quick_start__pynative_ds3.yaml",
        "tests__st__test_ut__test_pynative__test_monitor__monitor_test.yaml",
        "tests__st__test_ut__test_pynative__test_config__train_config.yaml",
    ],
)
def test_original_yaml_model_sections_are_accepted(file_name):
    cfg = build_model_config(validate_section("model", _model_section(file_name)))
    assert cfg.model_type in ("deepseek_v3", "qwen3")


def test_meta_build_then_materialise_and_init():
    torch.manual_seed(0)
    model = build_model(validate_section("model", {**TINY_LLAMA, "initializer_range": 0.05}), device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    w = model.embedding.word_embeddings.weight
    assert abs(w.std().item() - 0.05) < 0.005
    assert torch.equal(model.decoder.final_layernorm.weight, torch.ones(64))
    ids = torch.randint(0, 128, (1, 8))
    eager = build_model(validate_section("model", {**TINY_LLAMA, "initializer_range": 0.05}))
    eager.load_state_dict(model.state_dict())
    assert torch.allclose(model(ids).logits, eager(ids).logits)  # rope buffers were rebuilt too


def test_compute_dtype_rule():
    model = build_model(
        validate_section("model", {**TINY_LLAMA, "compute_dtype": "bf16", "params_dtype": "float32"})
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.params_dtype == torch.float32
    out = model(torch.randint(0, 128, (1, 8)), labels=torch.randint(0, 128, (1, 8)))
    assert model(torch.randint(0, 128, (1, 8))).logits.dtype == torch.bfloat16
    assert out.loss_sum.dtype == torch.float32


def test_no_weight_decay_names_are_norms_and_biases():
    model = build_model(validate_section("model", {**TINY_LLAMA, "attention_bias": True}))
    names = model.no_weight_decay_names()
    assert "decoder.layers.0.input_layernorm.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert "decoder.final_layernorm.weight" in names
    assert not any(n.endswith("linear_qkv.weight") or "word_embeddings" in n for n in names)


def test_original_transformer_config_names_are_aliases():
    cfg = build_model_config(
        validate_section(
            "model",
            {
                "model_type": "llama",
                "architectures": "LlamaForCausalLM",
                "num_layers": 3,
                "ffn_hidden_size": 96,
                "num_query_groups": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "vocab_size": 128,
                "rotary_base": 5e5,
            },
        )
    )
    assert (cfg.num_layers, cfg.intermediate_size, cfg.num_key_value_heads, cfg.rope_theta) == (3, 96, 2, 5e5)
    moe = build_model_config(
        validate_section(
            "model",
            {
                "model_type": "qwen3_moe",
                "architectures": "Qwen3MoeForCausalLM",
                "num_moe_experts": 4,
                "num_experts_per_tok": 2,
            },
        )
    )
    assert moe.num_experts == 4
    with pytest.raises(ConfigError, match=r"model\.num_layers"):
        build_model_config(validate_section("model", {**TINY_LLAMA, "num_layers": "3"}))
    with pytest.raises(ConfigError, match=r"model\.mtp_num_layers"):
        build_model_config(validate_section("model", {**TINY_LLAMA, "mtp_num_layers": 1}))  # no MTP in llama


def test_deepseek_balance_loss_defaults():
    assert build_model_config(validate_section("model", _tiny_ds3())).load_balancing_type == "none"
    cfg = build_model_config(validate_section("model", _tiny_ds3(aux_loss_alpha=0.001)))
    assert (cfg.load_balancing_type, cfg.aux_loss_coeff) == ("seq_aux_loss", 0.001)
    assert (
        build_model_config(
            validate_section("model", _tiny_ds3(aux_loss_alpha=0.001, seq_aux=False))
        ).load_balancing_type
        == "aux_loss"
    )
    assert build_model_config(validate_section("model", _tiny_ds3())).enable_expert_bias is True


def test_params_dtype_and_flash_attention_switches_warn_that_they_have_no_effect(caplog):
    import logging

    from lmforge.models import build_model_config

    caplog.set_level(logging.WARNING, logger="lmforge")
    section = {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "vocab_size": 64,
        "params_dtype": "bfloat16",
        "use_flash_attention": False,
    }
    build_model_config(validate_section("model", section))
    assert "model.params_dtype = 'bfloat16' has no effect" in caplog.text
    assert "model.use_flash_attention: false has no effect" in caplog.text
