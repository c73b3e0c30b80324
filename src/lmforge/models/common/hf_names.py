"""Hugging Face ↔ lmforge parameter mapping pieces shared by the family adapters.

Every adapter maps a whole state dict both ways; fused lmforge weights are row permutations of Hugging
Face's separate projections (``models/common/fused_layout.py``: ``linear_qkv`` grouped per key-value group
``[q heads of group g; k_g; v_g]``, ``linear_fc1`` and each expert's ``linear_fc1[e]`` in gate/up row pairs),
so the round trip lmforge → HF → lmforge is exact (no arithmetic, only copies). The same functions run
on row ids (``models/hf_read.py``), so they only move rows, never columns.
"""

from __future__ import annotations

import torch

from lmforge.errors import CheckpointError
from lmforge.models.common.transformer_config import TransformerConfig

HF = "model.layers.{i}."
LM = "decoder.layers.{i}."


def take(sd: dict[str, torch.Tensor], key: str, source: str = "Hugging Face checkpoint") -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(
            f"{source} is missing the tensor '{key}' (is the config.json of the same model?)."
        )
    return sd.pop(key)


def embeddings_from_hf(hf: dict, cfg: TransformerConfig, out: dict) -> None:
    out["embedding.word_embeddings.weight"] = take(hf, "model.embed_tokens.weight")
    out["decoder.final_layernorm.weight"] = take(hf, "model.norm.weight")
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    else:
        out["output_layer.weight"] = take(hf, "lm_head.weight")


def embeddings_to_hf(sd: dict, cfg: TransformerConfig, out: dict) -> None:
    out["model.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[q; k; v]`` rows (weights or biases) → rows grouped per key-value group."""
    per_group = [t.reshape(groups, t.shape[0] // groups, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def unfuse_qkv(qkv: torch.Tensor, q_rows: int, kv_rows: int, groups: int) -> list[torch.Tensor]:
    """The inverse of :func:`fuse_qkv`: ``q``, ``k``, ``v`` rows."""
    per_group = qkv.reshape(groups, -1, *qkv.shape[1:])
    parts = per_group.split([q_rows // groups, kv_rows // groups, kv_rows // groups], dim=1)
    return [p.reshape(-1, *qkv.shape[1:]) for p in parts]


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Gate and up rows along ``dim`` → gate/up row pairs."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def unfuse_gate_up(fused: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = fused.unflatten(dim, (-1, 2))
    return pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)


def gqa_attention_from_hf(hf: dict, hp: str, lp: str, cfg: TransformerConfig, out: dict) -> None:
    for kind in ("weight", "bias"):
        if kind == "bias" and not cfg.attention_bias:
            continue
        q, k, v = (take(hf, f"{hp}self_attn.{n}_proj.{kind}") for n in ("q", "k", "v"))
        out[f"{lp}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, cfg.num_key_value_heads)
        out[f"{lp}self_attention.linear_proj.{kind}"] = take(hf, f"{hp}self_attn.o_proj.{kind}")
    if cfg.qk_norm:
        out[f"{lp}self_attention.q_layernorm.weight"] = take(hf, f"{hp}self_attn.q_norm.weight")
        out[f"{lp}self_attention.k_layernorm.weight"] = take(hf, f"{hp}self_attn.k_norm.weight")


def gqa_attention_to_hf(sd: dict, hp: str, lp: str, cfg: TransformerConfig, out: dict) -> None:
    q_rows = cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    for kind in ("weight", "bias"):
        if kind == "bias" and not cfg.attention_bias:
            continue
        q, k, v = unfuse_qkv(
            sd[f"{lp}self_attention.linear_qkv.{kind}"], q_rows, kv_rows, cfg.num_key_value_heads
        )
        out[f"{hp}self_attn.q_proj.{kind}"], out[f"{hp}self_attn.k_proj.{kind}"] = q, k
        out[f"{hp}self_attn.v_proj.{kind}"] = v
        out[f"{hp}self_attn.o_proj.{kind}"] = sd[f"{lp}self_attention.linear_proj.{kind}"]
    if cfg.qk_norm:
        out[f"{hp}self_attn.q_norm.weight"] = sd[f"{lp}self_attention.q_layernorm.weight"]
        out[f"{hp}self_attn.k_norm.weight"] = sd[f"{lp}self_attention.k_layernorm.weight"]


def norms_from_hf(hf: dict, hp: str, lp: str, out: dict) -> None:
    out[f"{lp}input_layernorm.weight"] = take(hf, f"{hp}input_layernorm.weight")
    out[f"{lp}pre_mlp_layernorm.weight"] = take(hf, f"{hp}post_attention_layernorm.weight")


def norms_to_hf(sd: dict, hp: str, lp: str, out: dict) -> None:
    out[f"{hp}input_layernorm.weight"] = sd[f"{lp}input_layernorm.weight"]
    out[f"{hp}post_attention_layernorm.weight"] = sd[f"{lp}pre_mlp_layernorm.weight"]


def swiglu_from_hf(hf: dict, hp: str, lp: str, out: dict, bias: bool = False) -> None:
    """``{hp}gate_proj/up_proj/down_proj`` → ``{lp}linear_fc1/linear_fc2``."""
    for kind in ("weight", "bias") if bias else ("weight",):
        gate, up = take(hf, f"{hp}gate_proj.{kind}"), take(hf, f"{hp}up_proj.{kind}")
        out[f"{lp}linear_fc1.{kind}"] = fuse_gate_up(gate, up)
        out[f"{lp}linear_fc2.{kind}"] = take(hf, f"{hp}down_proj.{kind}")


def swiglu_to_hf(sd: dict, hp: str, lp: str, out: dict, bias: bool = False) -> None:
    for kind in ("weight", "bias") if bias else ("weight",):
        gate, up = unfuse_gate_up(sd[f"{lp}linear_fc1.{kind}"])
        out[f"{hp}gate_proj.{kind}"], out[f"{hp}up_proj.{kind}"] = gate, up
        out[f"{hp}down_proj.{kind}"] = sd[f"{lp}linear_fc2.{kind}"]


def experts_from_hf(hf: dict, hp: str, lp: str, num_experts: int, out: dict) -> None:
    """Per-expert ``experts.{e}.gate_proj/up_proj/down_proj`` (checkpoint format) or the fused 3-D
    ``experts.gate_up_proj`` ``[E, 2F, H]`` (rows ``[gate; up]``) / ``experts.down_proj`` ``[E, H, F]``
    (transformers 5 in memory)."""
    fused = f"{hp}experts.gate_up_proj"
    if fused in hf:
        gate, up = take(hf, fused).chunk(2, dim=1)
        out[f"{lp}experts.linear_fc1.weight"] = fuse_gate_up(gate, up, dim=1)
        out[f"{lp}experts.linear_fc2.weight"] = take(hf, f"{hp}experts.down_proj")
        return
    fc1, fc2 = [], []
    for e in range(num_experts):
        ep = f"{hp}experts.{e}."
        fc1.append(fuse_gate_up(take(hf, f"{ep}gate_proj.weight"), take(hf, f"{ep}up_proj.weight")))
        fc2.append(take(hf, f"{ep}down_proj.weight"))
    out[f"{lp}experts.linear_fc1.weight"] = torch.stack(fc1)
    out[f"{lp}experts.linear_fc2.weight"] = torch.stack(fc2)


def experts_to_hf(sd: dict, hp: str, lp: str, out: dict) -> None:
    fc1, fc2 = sd[f"{lp}experts.linear_fc1.weight"], sd[f"{lp}experts.linear_fc2.weight"]
    for e in range(fc1.shape[0]):
        gate, up = unfuse_gate_up(fc1[e])
        ep = f"{hp}experts.{e}."
        out[f"{ep}gate_proj.weight"], out[f"{ep}up_proj.weight"] = gate, up
        out[f"{ep}down_proj.weight"] = fc2[e]


def rope_hf_config(cfg: TransformerConfig) -> dict:
    """``rope_parameters`` (transformers 5) plus ``rope_theta`` / ``rope_scaling`` (transformers 4)."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        params.update(cfg.rope_scaling)
    return {"rope_parameters": params}


def base_hf_config(cfg: TransformerConfig) -> dict:
    return {
        "architectures": [cfg.architectures],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "attention_dropout": cfg.attention_dropout,
        **rope_hf_config(cfg),
    }
