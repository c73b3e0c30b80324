"""Each parallel layout reproduces the single-process losses and gradient norms of the same global batch.

Models are lmforge's own families (tiny, fp32: Llama with GQA, Qwen3-MoE with a balancing loss,
DeepSeek-V3 with MLA and shared experts); the reference is a plain torch loop (see harness.py). One
spawn per world size runs all its layouts in turn (process start-up dominates on 2 cores).

Tolerance: fp32 end to end, the layouts only change summation orders, so 1e-5 relative on the loss
and 1e-4 on the gradient norm over 2 AdamW steps (lr 3e-3, clipping at 1.0). A wrong shard, a missing
or doubled reduction, or a wrong micro-batch weighting moves them by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import validate_section

from .harness import (
    INIT_SEED,
    make_data,
    reference_run,
    run_workers,
    tiny_deepseek,
    tiny_llama,
    tiny_qwen3_moe,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2  # the second step checks the first update (optimizer, clipping, synced grads)
SEQ = 16
GBS = 4
MODELS = {
    "llama": tiny_llama,
    "llama_bf16": lambda: tiny_llama(compute_dtype="bfloat16"),
    "llama_docs": tiny_llama,  # the data has packed documents (actual_seq_len)
    "llama_tied": lambda: tiny_llama(tie_word_embeddings=True),
    # The loss: the default chunk (512) is one chunk of these 16-token micro-batches; 4 gives several
    # chunks (two under cp), 0 the plain loss with whole logits.
    "llama_plain_loss": lambda: tiny_llama(loss_chunk_size=0),
    "llama_chunk4": lambda: tiny_llama(loss_chunk_size=4),
    "llama_tied_plain_loss": lambda: tiny_llama(tie_word_embeddings=True, loss_chunk_size=0),
    "llama_tied_chunk4": lambda: tiny_llama(tie_word_embeddings=True, loss_chunk_size=4),
    "qwen3_moe": tiny_qwen3_moe,
    "deepseek": tiny_deepseek,
    "deepseek_mtp": lambda: tiny_deepseek(num_nextn_predict_layers=1),
    # MLA without q-LoRA (q projected straight from the block input). Under TP its step-1 loss exposed
    # expert-bias counts summed over data parallel only (each tp rank steered the bias by its own tokens).
    "deepseek_no_q_lora": lambda: tiny_deepseek(q_lora_rank=None),
}
TOL = {"loss": 1e-5, "grad_norm": 1e-4}


def _run_cases(cases: list[dict], world: int, tmp_path) -> None:
    from lmforge.models import build_model

    refs = {}
    for name in {c["model_name"] for c in cases}:
        section = MODELS[name]()
        torch.manual_seed(0)
        model = build_model(validate_section("model", section), seed=INIT_SEED)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        data = make_data(STEPS, GBS, SEQ, section["vocab_size"], documents=name.endswith("_docs"))
        for case in cases:
            key = _ref_key(case)
            if case["model_name"] == name and key not in refs:
                refs[key] = reference_run(section, state, data, 1, case.get("optimizer"))
        torch.save(state, tmp_path / f"{name}_state.pt")
        torch.save(data, tmp_path / f"{name}_data.pt")
    spec_cases = [
        {
            "name": c["name"],
            "model": MODELS[c["model_name"]](),
            "parallelism": c["parallelism"],
            "optimizer": c.get("optimizer"),
            "activation": c.get("activation"),
            "state": str(tmp_path / f"{c['model_name']}_state.pt"),
            "data": str(tmp_path / f"{c['model_name']}_data.pt"),
        }
        for c in cases
    ]
    results = run_workers(
        world, {"task": "train_task", "cases": spec_cases, "gbs": GBS, "lbs": 1}, timeout=170
    )
    failures = []
    worst = dict.fromkeys(TOL, 0.0)
    for case in cases:
        ref = refs[_ref_key(case)]
        for rank, res in enumerate(results):
            got = res[case["name"]]
            for key, rel in (case.get("tol") or TOL).items():
                for step, (a, b) in enumerate(zip(got[key], ref[key])):
                    if not case.get("tol"):  # the fp32 layouts' summary
                        worst[key] = max(worst[key], abs(a - b) / abs(b))
                    if not math.isclose(a, b, rel_tol=rel, abs_tol=1e-7):
                        failures.append(
                            f"{case['name']} rank {rank} {key} step {step}: {a} vs single-process {b}"
                        )
    print(
        f"{world} ranks, largest relative difference: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    assert not failures, "\n".join(failures)


def _case(name, model_name, optimizer=None, tol=None, activation=None, **parallelism):
    return {
        "name": name,
        "model_name": model_name,
        "parallelism": parallelism,
        "optimizer": optimizer,
        "tol": tol,
        "activation": activation,
    }


def _ref_key(case) -> tuple:
    return (case["model_name"], repr(case.get("optimizer")))


# Muon with QK-Clip at a threshold the tiny model exceeds (the clip changes the losses), NS in fp32 so
# the comparison stays tight: the sharded update and the max-logit reduction are what is checked.
MUON = {"type": "Muon", "qk_clip_threshold": 0.5, "ns_dtype": "float32"}
# bf16 compute with fp32 masters on both sides (lmforge's AdamW keeps them on one process; FSDP stores
# fp32 shards). FSDP changes no bf16 rounding (tight); TP sums bf16 partial products in another order,
# so its tolerance is a fraction of bf16's epsilon (7.8e-3).
ADAMW = {"type": "AdamW", "weight_decay": 0.01}
BF16_TP_TOL = {"loss": 3e-3, "grad_norm": 1e-2}
# Recompute (full, select, collectives only) and swap wrappers under FSDP2 and context-parallel attention.
ACTIVATION = {
    "recompute": {"mode": "select", "full_recompute_layer": ["0"], "select_module": {"mlp": ["1"]}},
    "recompute_comm": {"enable": True, "select_module": {"self_attention": ["3"]}},
    "swap": {"enable": True, "layer_swap": [{"layers": ["2"]}], "default_prefetch": 1},
}


@pytest.mark.timeout(200)
def test_two_rank_layouts_match_single_process(tmp_path):
    cases = [
        _case("fsdp", "llama"),
        _case("fsdp_cpu_offload", "llama", cpu_offload=True),
        _case(
            "fsdp_zero2_never_reshard",
            "llama",
            data_parallel_shard_strategy="optim_grads",
            reshard_after_forward_policy="never",
        ),
        _case("tp_sp", "llama", tensor_parallel=2, sequence_parallel=True),
        _case("pp_1f1b", "llama", pipeline_parallel=2, pipeline_parallel_schedule="1f1b"),
        _case("pp_gpipe", "llama", pipeline_parallel=2, pipeline_parallel_schedule="gpipe"),
        _case(
            "pp_interleaved",
            "llama",
            pipeline_parallel=2,
            pipeline_parallel_schedule="interleaved_1f1b",
            pipeline_parallel_interleave_num=2,
        ),
        _case(
            "pp_uneven_layers", "llama", pipeline_parallel=2, pipeline_parallel_layers_per_stage=["0", "1-3"]
        ),
        _case("cp_allgather_kv", "llama", context_parallel=2),
        _case("cp_ulysses", "llama", context_parallel=2, context_parallel_method="ulysses"),
        _case("cp_allgather_kv_documents", "llama_docs", context_parallel=2),
        _case("cp_ulysses_documents", "llama_docs", context_parallel=2, context_parallel_method="ulysses"),
        _case(
            "cp_ulysses_recompute_swap",
            "llama",
            activation=ACTIVATION,
            context_parallel=2,
            context_parallel_method="ulysses",
        ),
        # all-gather-KV attention builds its causal bias in place: recompute_comm re-runs that with the
        # collectives (it failed in backward: "Tensor cached during selective activation checkpoint has
        # been mutated")
        _case("cp_allgather_kv_recompute_swap", "llama", activation=ACTIVATION, context_parallel=2),
        _case("tp_documents", "llama_docs", tensor_parallel=2),
        _case("tp_tied_embeddings", "llama_tied", tensor_parallel=2),
        _case("pp_tied_embeddings", "llama_tied", pipeline_parallel=2),
        _case("pp_plain_loss", "llama_plain_loss", pipeline_parallel=2),
        _case(
            "pp_interleaved_chunk4",
            "llama_chunk4",
            pipeline_parallel=2,
            pipeline_parallel_schedule="interleaved_1f1b",
            pipeline_parallel_interleave_num=2,
        ),
        _case("pp_tied_embeddings_plain_loss", "llama_tied_plain_loss", pipeline_parallel=2),
        _case("pp_tied_embeddings_chunk4", "llama_tied_chunk4", pipeline_parallel=2),
        _case("pp_moe", "qwen3_moe", pipeline_parallel=2),  # balancing loss inside the schedule's backward
        _case("pp_documents", "llama_docs", pipeline_parallel=2),  # masks reach every stage as step kwargs
        _case(
            "pp_interleaved_recompute",
            "llama",
            activation={"recompute": ACTIVATION["recompute"]},  # (swap is refused with pipeline parallel)
            pipeline_parallel=2,
            pipeline_parallel_schedule="interleaved_1f1b",
            pipeline_parallel_interleave_num=2,
        ),
        _case("ep_alltoall", "qwen3_moe", expert_parallel=2),
        _case("tp_moe", "qwen3_moe", tensor_parallel=2),
        _case("tp_mla_shared_experts", "deepseek", tensor_parallel=2),
        _case("tp_mtp", "deepseek_mtp", tensor_parallel=2),
        _case("tp_mla_no_q_lora", "deepseek_no_q_lora", tensor_parallel=2),
        _case(
            "ep_mla",
            "deepseek",
            expert_parallel=2,
            moe_token_dispatcher_type="alltoall_deredundancy",
            npu_nums_per_device=2,
        ),
        _case(
            "muon_qkclip_cp_ulysses", "deepseek", MUON, context_parallel=2, context_parallel_method="ulysses"
        ),
        _case("muon_qkclip_cp_allgather_kv", "deepseek", MUON, context_parallel=2),
    ]
    _run_cases(cases, 2, tmp_path)


@pytest.mark.timeout(200)
def test_four_rank_layouts_match_single_process(tmp_path):
    cases = [
        _case("hsdp", "llama", data_parallel_shard=2),
        _case("fsdp_x_tp", "llama", tensor_parallel=2),
        _case("pp_x_fsdp", "llama", pipeline_parallel=2),
        _case("cp_x_tp", "llama", context_parallel=2, tensor_parallel=2),
        _case("pp_x_cp", "llama", context_parallel=2, pipeline_parallel=2),
        _case("pp_x_fsdp_tied_embeddings", "llama_tied", pipeline_parallel=2),
        _case("pp_x_tp", "llama", pipeline_parallel=2, tensor_parallel=2),
        _case("pp_x_tp_plain_loss", "llama_plain_loss", pipeline_parallel=2, tensor_parallel=2),
        _case(
            "pp_x_tp_chunk4", "llama_chunk4", pipeline_parallel=2, tensor_parallel=2
        ),  # vocabulary-parallel
        _case("pp_x_cp_chunk4", "llama_chunk4", context_parallel=2, pipeline_parallel=2),
        _case("pp_x_fsdp_tied_embeddings_plain_loss", "llama_tied_plain_loss", pipeline_parallel=2),
        _case("ep_x_fsdp", "qwen3_moe", expert_parallel=2),
        _case("ep_x_tp", "qwen3_moe", expert_parallel=2, tensor_parallel=2),
        _case("muon_qkclip_fsdp_x_tp", "deepseek", MUON, tensor_parallel=2),
        _case("muon_deredundency_fsdp", "deepseek", {**MUON, "comm_strategy": "allgather_deredundency"}),
        _case("cp_hybrid_documents", "llama_docs", context_parallel=4, ulysses_degree_in_cp=2),
        _case("cp4_allgather_kv_documents", "llama_docs", context_parallel=4),
        _case("muon_qkclip_cp_hybrid_ulysses", "deepseek", MUON, context_parallel=4, ulysses_degree_in_cp=2),
    ]
    _run_cases(cases, 4, tmp_path)
