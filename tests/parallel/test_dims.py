"""ParallelDims, layer-per-stage strings, accumulation steps and the per-rank memory estimate (no processes)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError, NotSupportedError
from lmforge.models import build_model
from lmforge.parallel import ParallelDims, accumulation_steps
from lmforge.parallel.api import refuse_unsupported
from lmforge.parallel.pp_layout import stage_layers, stages_of_rank
from lmforge.tools.memory import describe_ranks, estimate_memory


def _par(mapping):
    """The typed parallelism section of ``mapping``, as load_config types it."""
    return validate_section("parallelism", mapping)


def _training(**keys):
    return validate_section("training", keys)


def _optimizer(**keys):
    return validate_section("optimizer", keys)


def test_pure_fsdp_takes_all_remaining_ranks():
    d = ParallelDims.from_section(_par({"tensor_parallel": 2, "pipeline_parallel": 2}), 16)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (2, 1, 4, 1, 2)
    assert d.dp == 4 and d.fsdp_size == 4


def test_smaller_shard_gives_hsdp():
    d = ParallelDims.from_section(_par({"data_parallel_shard": 2}), 8)
    assert (d.dp_replicate, d.dp_shard, d.dp) == (4, 2, 8)


def test_expert_parallel_borrows_from_dp_and_cp():
    d = ParallelDims.from_section(_par({"context_parallel": 2, "expert_parallel": 4}), 8)
    assert d.world_size == d.pp * d.dp * d.cp * d.tp == 8
    assert d.fsdp_size == 8 and d.expert_fsdp_size == 2


@pytest.mark.parametrize(
    "section,world,key",
    [
        ({"tensor_parallel": 4, "pipeline_parallel": 2}, 4, "must be less than or equal to world_size"),
        ({"tensor_parallel": 4}, 6, "parallelism.tensor_parallel\\(4\\)"),
        ({"tensor_parallel": 3}, 8, "not divisible"),
        ({"data_parallel_shard": 3}, 8, "parallelism.data_parallel_shard=3"),
        ({"data_parallel_shard": 0}, 8, "parallelism.data_parallel_shard must be -1"),
        ({"expert_parallel": 3}, 8, "parallelism.expert_parallel=3"),
        ({"tensor_parallel": 0}, 8, "parallelism.tensor_parallel must be a positive integer"),
        ({"context_parallel": 4, "ulysses_degree_in_cp": 3}, 8, "parallelism.ulysses_degree_in_cp"),
    ],
)
def test_degree_errors_name_the_key(section, world, key):
    with pytest.raises(ConfigError, match=key):
        ParallelDims.from_section(_par(section), world)


@pytest.mark.parametrize(
    "section,kwargs,key",
    [
        ({"tensor_parallel": 2}, {"num_heads": 6, "num_kv_heads": 3}, "number of key/value heads"),
        ({"tensor_parallel": 4}, {"num_heads": 6}, "number of attention heads"),
        ({"expert_parallel": 2}, {"num_experts": 3}, "routed experts"),
        ({"expert_parallel": 2}, {"num_experts": 0}, "needs a mixture-of-experts model"),
        ({"context_parallel": 2}, {"seq_length": 18}, "sequence length 18"),
        ({"pipeline_parallel": 2}, {"num_layers": 3}, "Number of layers \\(3\\) is not divisible"),
        (
            {"context_parallel": 2, "context_parallel_method": "ulysses"},
            {"num_heads": 3},
            "ulysses_degree_in_cp",
        ),
    ],
)
def test_model_checks(section, kwargs, key):
    d = ParallelDims.from_section(_par(section), section.get("tensor_parallel", 2))
    args = {"num_layers": 4, **kwargs}
    with pytest.raises(ConfigError, match=key):
        d.check_model(**args)


def test_layers_per_stage_strings():
    assert stage_layers("auto", num_layers=8, pp=2, interleave=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # chunk c of rank r is virtual stage c*pp + r
    assert stage_layers(["0-1,4-5", "2-3,6-7"], num_layers=8, pp=2, interleave=2) == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert stage_layers(["0", "1-3"], num_layers=4, pp=2) == [[0], [1, 2, 3]]
    assert stages_of_rank(1, 2, 2) == [1, 3]


@pytest.mark.parametrize(
    "value,match",
    [
        (["0-3"], "has 1 entries but parallelism.pipeline_parallel is 2"),
        (["0-1", "2-x"], "invalid layer range format"),
        (["3-1", "0"], "layer_start must be less than or equal to layer_end"),
        (["0-1", "1-3"], "exactly one stage"),
        (["0-1,2", "3"], "chunk"),
        ([[0, 1], [2, 3]], "a list of lists is not supported"),
    ],
)
def test_layers_per_stage_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        stage_layers(value, num_layers=4, pp=2)


def test_option_errors_are_refused_when_the_section_is_typed():
    for section, match in [
        ({"reshard_after_forward_policy": "sometimes"}, "reshard_after_forward_policy"),
        ({"data_parallel_shard_strategy": "zero3"}, "data_parallel_shard_strategy"),
        ({"data_parallel_shard_strategy": "no_shard"}, "data_parallel_shard_strategy"),
        ({"context_parallel_method": "ring"}, "context_parallel_method"),
        ({"pipeline_parallel_schedule": "zb"}, "pipeline_parallel_schedule"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _par(section)


def test_valid_but_unimplemented_values_are_refused_with_the_degrees():
    # The spec allows them (the section types), lmforge cannot run them: deriving the degrees refuses.
    for section, world, match in [
        ({"context_parallel_mask_type": "full"}, 1, "context_parallel_mask_type supports only 'causal'"),
        ({"context_parallel": 2, "context_parallel_async": True}, 2, "context_parallel_async: true"),
        ({"dense_fsdp_shard_size": 2}, 1, "dense_fsdp_shard_size is not supported"),
        ({"pipeline_parallel": 2, "pipeline_parallel_interleave_num": 2}, 2, "interleaved_1f1b"),
    ]:
        typed = _par(section)
        with pytest.raises(ConfigError, match=match):
            ParallelDims.from_section(typed, world)
    # one pipeline stage per rank: nothing to interleave, so any schedule runs
    assert ParallelDims.from_section(_par({"pipeline_parallel_interleave_num": 2}), 1).pp == 1


def test_from_section_takes_only_the_typed_section():
    with pytest.raises(TypeError, match="typed parallelism section"):
        ParallelDims.from_section({"tensor_parallel": 2}, 2)


@pytest.mark.parametrize(
    "section,method",
    [
        ({"context_parallel": 4}, "colossal"),
        ({"context_parallel": 4, "context_parallel_method": "ulysses"}, "ulysses"),
        ({"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 2}, "hybrid"),
        ({"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 4}, "ulysses"),
        ({"context_parallel": 4, "ulysses_degree_in_cp": 2}, "hybrid"),
    ],
)
def test_cp_method_follows_the_degrees(section, method):
    assert ParallelDims.from_section(_par(section), 4).cp_method == method


def test_accumulation_steps_floor_and_error():
    assert accumulation_steps(16, 2, 4) == 2
    assert accumulation_steps(18, 2, 4) == 2  # the spec's floor division (warned)
    with pytest.raises(ConfigError, match="exceeds global_batch_size"):
        accumulation_steps(4, 2, 4)


def test_memory_estimate_scales_with_sharding():
    from lmforge.models import build_model

    section = {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "tie_word_embeddings": False,
    }
    model = build_model(validate_section("model", section), device="meta")
    n = sum(p.numel() for p in model.parameters())
    kw = dict(
        compute_dtype=torch.bfloat16,
        optimizer_type="AdamW",
        seq_length=128,
        local_batch_size=2,
        hidden_size=64,
        num_layers=4,
        vocab_size=256,
    )
    one = estimate_memory(model, ParallelDims.from_section(_par({}), 1), **kw)
    assert one.local_parameter_count == n
    # One process is FSDP2 over one rank too: fp32 parameters (the masters), bf16 gathered copies.
    assert one.parameters == 4 * n and one.gradients == 4 * n and one.gathered_parameters > 0
    assert one.optimizer_states == 8 * n
    four = estimate_memory(model, ParallelDims.from_section(_par({}), 4), **kw)
    assert four.local_parameter_count == n // 4
    assert four.parameters == 4 * (n // 4)
    assert four.activations == one.activations  # FSDP does not split activations
    tp = estimate_memory(model, ParallelDims.from_section(_par({"tensor_parallel": 2}), 2), **kw)
    assert tp.activations < one.activations
    assert one.activations_recompute < one.activations
    lines = describe_ranks(
        ParallelDims.from_section(_par({"tensor_parallel": 2, "data_parallel_shard": 2}), 8)
    )
    assert len(lines) == 8 and "tensor shard 1/2" in lines[1] and "replica" in lines[0]


def test_parallel_plan_for_check():
    from lmforge.tools.report import parallel_plan

    model = {
        "model_type": "qwen3_moe",
        "architectures": "Qwen3MoeForCausalLM",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 128,
        "seq_length": 64,
    }
    par = {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2}
    lines = parallel_plan(
        _par(par),
        validate_section("model", model),
        _training(global_batch_size=8, local_batch_size=2),
        _optimizer(type="AdamW"),
        8,
    )
    text = "\n".join(lines)
    assert "pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2; expert parallel 2" in text
    assert "micro-batches per step (= pipeline micro-batches): 2" in text
    assert "pipeline stage 1 (pp rank 1): layers 2-3" in text
    assert "rank 7: pp stage 1" in text and "total with full recompute" in text
    with pytest.raises(ConfigError, match="parallelism.expert_parallel=3"):
        parallel_plan(
            _par({"expert_parallel": 3}),
            validate_section("model", model),
            _training(global_batch_size=8),
            _optimizer(),
            6,
        )


def test_unsupported_combinations_are_reported_by_check_and_refused_at_start():
    from lmforge.tools.report import parallel_plan

    model = {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": 64,
        "seq_length": 16,
        "tie_word_embeddings": True,
    }
    # A valid file (the original accepts it): check warns, the trainer's parallelize refuses.
    lines = parallel_plan(
        _par({"pipeline_parallel": 2, "tensor_parallel": 2}),
        validate_section("model", model),
        _training(global_batch_size=4),
        _optimizer(),
        4,
    )
    assert any("tied word embeddings" in line and "will refuse" in line for line in lines)
    dims = ParallelDims.from_section(_par({"pipeline_parallel": 2, "tensor_parallel": 2}), 4)
    with pytest.raises(NotSupportedError, match="tied word embeddings"):
        refuse_unsupported(build_model(validate_section("model", model), device="meta"), dims)
    assert parallel_plan(
        _par({"pipeline_parallel": 2}),
        validate_section("model", model),
        _training(global_batch_size=4),
        _optimizer(),
        2,
    )
