"""Parameter groups: weight-decay priority, lr multipliers, tied and missing parameters."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.optim import AdamW, build_optimizer

from .optim_helpers import TinyLM


def _groups_by_name(opt):
    out = {}
    for g in opt.param_groups:
        for name in g["param_names"]:
            out[name] = g
    return out


def test_default_rules_and_priority():
    model = TinyLM()
    opt = build_optimizer(
        validate_section(
            "optimizer",
            {
                "weight_decay": 0.1,
                "weight_decay_include": [
                    "decoder.final_layernorm.weight"
                ],  # exact name beats the 1-D default
                "weight_decay_exclude": [
                    "linear_proj",
                    "*final_layernorm*",
                ],  # substring; glob loses to include
            },
        ),
        model,
        1e-3,
    )
    g = _groups_by_name(opt)
    wd = {n: grp["weight_decay"] for n, grp in g.items()}
    assert wd["decoder.final_layernorm.weight"] == 0.1  # include beats exclude and the 1-D default
    assert wd["decoder.final_layernorm.bias"] == 0.0  # exclude glob
    assert wd["decoder.layers.0.self_attention.linear_proj.weight"] == 0.0  # exclude substring
    assert wd["decoder.layers.0.input_layernorm.weight"] == 0.0  # 1-D
    assert wd["decoder.layers.0.self_attention.linear_qkv.bias"] == 0.0  # bias
    assert wd["embedding.word_embeddings.weight"] == 0.0  # model's declared no-decay name
    assert wd["decoder.layers.0.mlp.linear_fc1.weight"] == 0.1  # default
    assert wd["output_layer.weight"] == 0.1


def test_lr_scale_groups_and_initial_lr_from_a_schedule():
    class Schedule:
        def lr_at(self, step):
            return 2e-3 if step == 0 else 0.0

    opt = build_optimizer(
        validate_section("optimizer", {"lr_scale": {"*word_embeddings*": 0.5, "output_layer": 0.25}}),
        TinyLM(),
        Schedule(),
    )
    g = _groups_by_name(opt)
    assert g["embedding.word_embeddings.weight"]["lr_scale"] == 0.5
    assert g["embedding.word_embeddings.weight"]["lr"] == pytest.approx(1e-3)
    assert g["output_layer.weight"]["lr"] == pytest.approx(5e-4)
    assert g["decoder.layers.0.mlp.linear_fc1.weight"]["lr_scale"] == 1.0
    assert g["decoder.layers.0.mlp.linear_fc1.weight"]["lr"] == pytest.approx(2e-3)
    for grp in opt.param_groups:
        assert len({(grp["weight_decay"], grp["lr_scale"])}) == 1


def test_tied_embedding_is_one_parameter_with_one_state():
    model = TinyLM(tie=True)
    # The output layer is the embedding: a rule on either name applies to the shared tensor.
    opt = build_optimizer(
        validate_section("optimizer", {"weight_decay": 0.1, "lr_scale": {"output_layer*": 0.5}}), model, 1e-3
    )
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert len(opt.state) == len(params)
    emb = model.embedding.word_embeddings.weight
    grp = next(g for g in opt.param_groups if any(p is emb for p in g["params"]))
    assert grp["lr_scale"] == 0.5


def test_hand_made_groups_with_a_duplicate_or_a_missing_parameter_are_errors():
    model = TinyLM(tie=True)
    emb = model.embedding.word_embeddings.weight
    rest = [p for n, p in model.named_parameters() if p is not emb]
    with pytest.raises(ConfigError, match="appears in group 0 and group 1"):
        AdamW([{"params": [emb] + rest}, {"params": [model.output_layer.weight]}], model=model)
    with pytest.raises(
        ConfigError, match=r"embedding\.word_embeddings\.weight \(tied: output_layer\.weight\)"
    ):
        AdamW([{"params": rest}], model=model)


def test_frozen_parameters_are_not_grouped():
    model = TinyLM()
    model.output_layer.weight.requires_grad_(False)
    opt = build_optimizer(validate_section("optimizer", {}), model, 1e-3)
    assert all(p is not model.output_layer.weight for g in opt.param_groups for p in g["params"])


def test_summary_table_is_logged(caplog):
    import logging

    logging.getLogger("lmforge").propagate = True
    caplog.set_level(logging.DEBUG, logger="lmforge")
    build_optimizer(validate_section("optimizer", {"weight_decay_exclude": ["linear_proj"]}), TinyLM(), 1e-3)
    assert "group" in caplog.text and "lr scale" in caplog.text
    assert "reason: custom_exclude:linear_proj" in caplog.text


def test_muon_routes_by_shape_and_adamw_include():
    model = TinyLM()
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Muon", "qk_clip_enabled": False}), model, 1e-3
    )
    route = {n: g["route"] for g in opt.param_groups for n in g["param_names"]}
    assert route["decoder.layers.0.self_attention.linear_qkv.weight"] == "muon"
    assert route["decoder.layers.0.mlp.linear_fc2.weight"] == "muon"
    assert route["embedding.word_embeddings.weight"] == "adamw"
    assert route["output_layer.weight"] == "adamw"
    assert route["decoder.final_layernorm.weight"] == "adamw"
    assert route["decoder.layers.0.self_attention.linear_qkv.bias"] == "adamw"
    assert isinstance(opt.state[model.output_layer.weight]["exp_avg"], torch.Tensor)
    assert "momentum_buffer" in opt.state[model.decoder.layers[0].mlp.linear_fc1.weight]


def test_pipeline_chunks_share_one_optimizer_and_the_same_rules():
    first, last = TinyLM(), TinyLM()
    opt = build_optimizer(
        validate_section(
            "optimizer", {"weight_decay_exclude": ["linear_proj"], "lr_scale": {"output_layer": 0.5}}
        ),
        [first, last],
        1e-3,
    )
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len(list(first.parameters())) + len(list(last.parameters()))
    for chunk in (first, last):
        proj = chunk.decoder.layers[0].self_attention.linear_proj.weight
        out = chunk.output_layer.weight
        assert next(g for g in opt.param_groups if any(p is proj for p in g["params"]))["weight_decay"] == 0.0
        assert next(g for g in opt.param_groups if any(p is out for p in g["params"]))["lr_scale"] == 0.5


def test_weight_decay_values_per_pattern_apply_only_to_decaying_parameters():
    # The article's groups: embedding 0.02, transformer layers 0.01; norms and biases keep 0.
    model = TinyLM()
    opt = build_optimizer(
        validate_section(
            "optimizer",
            {
                "weight_decay": 0.1,
                "weight_decay_include": ["*word_embeddings*"],  # TinyLM declares the embedding no-decay
                "weight_decay_values": {"*word_embeddings*": 0.02, "decoder.layers": 0.01},
            },
        ),
        model,
        1e-3,
    )
    wd = {n: grp["weight_decay"] for n, grp in _groups_by_name(opt).items()}
    assert wd["embedding.word_embeddings.weight"] == 0.02
    assert wd["decoder.layers.0.mlp.linear_fc1.weight"] == 0.01
    assert wd["decoder.layers.0.self_attention.linear_proj.weight"] == 0.01
    assert wd["decoder.layers.0.input_layernorm.weight"] == 0.0  # 1-D: no decay despite the rule
    assert wd["decoder.layers.0.self_attention.linear_qkv.bias"] == 0.0
    assert wd["output_layer.weight"] == 0.1  # no rule: the section's weight_decay
    names = {g["name"] for g in opt.param_groups}
    assert {"decay_0.02", "decay_0.01", "decay", "no_decay"} <= names

    # The decay each group applies is its own: one AdamW step with zero gradients against torch.
    emb = model.embedding.word_embeddings.weight
    before = emb.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    ref = torch.nn.Parameter(before.clone())
    ref.grad = torch.zeros_like(ref)
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.02)
    torch_opt.step()
    torch.testing.assert_close(emb.detach(), ref.detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "value, needle",
    [
        ([0.1], "optimizer.weight_decay_values: expected a mapping"),
        ({"*emb*": -0.1}, "optimizer.weight_decay_values.*emb*: Invalid weight_decay value"),
        ({"*emb*": "x"}, "optimizer.weight_decay_values.*emb*: expected a number"),
    ],
)
def test_weight_decay_values_validation(value, needle):
    with pytest.raises(ConfigError) as info:
        build_optimizer(validate_section("optimizer", {"weight_decay_values": value}), TinyLM(), 1e-3)
    assert needle in str(info.value)
