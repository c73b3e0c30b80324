"""DeepSeek-V3 ↔ Hugging Face ``DeepseekV3ForCausalLM`` names and layouts.

| Hugging Face                                           | lmforge                                                      |
|--------------------------------------------------------|--------------------------------------------------------------|
| model.layers.N.self_attn.q_proj.weight (no q LoRA)     | decoder.layers.N.self_attention.linear_q_proj.weight (*)     |
| model.layers.N.self_attn.q_a_proj.weight               | decoder.layers.N.self_attention.linear_q_down_proj.weight    |
| model.layers.N.self_attn.q_a_layernorm.weight          | decoder.layers.N.self_attention.q_layernorm.weight           |
| model.layers.N.self_attn.q_b_proj.weight               | decoder.layers.N.self_attention.linear_q_up_proj.weight (*)  |
| model.layers.N.self_attn.kv_a_proj_with_mqa.weight     | decoder.layers.N.self_attention.linear_kv_down_proj.weight (†) |
| model.layers.N.self_attn.kv_a_layernorm.weight         | decoder.layers.N.self_attention.kv_layernorm.weight          |
| model.layers.N.self_attn.kv_b_proj.weight              | decoder.layers.N.self_attention.linear_kv_up_proj.weight (‡) |
| model.layers.N.self_attn.o_proj.weight                 | decoder.layers.N.self_attention.linear_proj.weight           |
| model.layers.N.mlp.{gate,up,down}_proj (dense layers)  | decoder.layers.N.mlp.linear_fc1 / linear_fc2                 |
| model.layers.N.mlp.gate.weight                         | decoder.layers.N.mlp.router.weight                           |
| model.layers.N.mlp.gate.e_score_correction_bias        | decoder.layers.N.mlp.router.expert_bias                      |
| model.layers.N.mlp.experts.E.{gate,up,down}_proj       | decoder.layers.N.mlp.experts.linear_fc1[E] / linear_fc2[E]   |
| model.layers.N.mlp.shared_experts.{gate,up,down}_proj  | decoder.layers.N.mlp.shared_experts.linear_fc1 / linear_fc2  |
| model.layers.(L+K).{enorm,hnorm,eh_proj}               | mtp.layers.K.{enorm,hnorm,eh_proj}                           |
| model.layers.(L+K).shared_head.norm                    | mtp.layers.K.final_layernorm                                 |
| model.layers.(L+K).<decoder layer keys>                | mtp.layers.K.transformer_layer.<decoder layer keys>          |
| model.layers.(L+K).{embed_tokens, shared_head.head}    | (shared with the main embedding / output layer; written on export) |

(*) rows per head ``[nope (qk_nope); rope (qk_rope)]`` in both (lmforge's layout is Hugging Face's).
(†) the last qk_rope rows are the shared rope key. (‡) rows per head ``[k_nope; v]`` in both.
With ``rope_interleave: true`` (the default, DeepSeek's own layout) the rope rows of q and k hold
interleaved pairs; they are reordered to the rotate-half layout lmforge uses (evens then odds), which
gives the same attention logits. Hugging Face itself ignores MTP weights (it does not train MTP).
"""

from __future__ import annotations

import torch

from lmforge.models.common import hf_names as h
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.models")

# config.json keys transformers derives from others (not structure keys of the model section).
HF_DERIVED_KEYS = ("qk_head_dim", "head_dim", "output_router_logits")
HF_RENAMES = {"num_mtp_layers": "num_nextn_predict_layers", "num_local_experts": "n_routed_experts"}


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rope rows ``[..., dr, in]`` from interleaved pairs (0,1),(2,3)… to halves (0,2,4…, 1,3,5…)."""
    return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2)


def _interleave(rows: torch.Tensor) -> torch.Tensor:
    half = rows.shape[-2] // 2
    out = torch.empty_like(rows)
    out[..., 0::2, :], out[..., 1::2, :] = rows[..., :half, :], rows[..., half:, :]
    return out


def _heads_from_hf(w: torch.Tensor, n: int, first: int, second: int, rope_second: bool) -> torch.Tensor:
    """Per-head rows stay per head; only the rope rows of each head are reordered (when interleaved)."""
    if not rope_second:
        return w
    per_head = w.view(n, first + second, w.shape[-1])
    a, b = per_head[:, :first], _deinterleave(per_head[:, first:])
    return torch.cat([a, b], dim=1).reshape(n * (first + second), -1)


def _heads_to_hf(w: torch.Tensor, n: int, first: int, second: int, rope_second: bool) -> torch.Tensor:
    if not rope_second:
        return w
    per_head = w.view(n, first + second, w.shape[-1])
    a, b = per_head[:, :first], _interleave(per_head[:, first:])
    return torch.cat([a, b], dim=1).reshape(n * (first + second), -1)


def _interleaved(cfg: TransformerConfig) -> bool:
    return bool(cfg.hf_extra.get("rope_interleave", True))


def _layer_from_hf(hf: dict, hp: str, lp: str, layer_id: int, cfg: TransformerConfig, out: dict) -> None:
    n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    il = _interleaved(cfg)
    a, ap = f"{hp}self_attn.", f"{lp}self_attention."
    h.norms_from_hf(hf, hp, lp, out)
    if cfg.q_lora_rank:
        out[f"{ap}linear_q_down_proj.weight"] = h.take(hf, f"{a}q_a_proj.weight")
        out[f"{ap}q_layernorm.weight"] = h.take(hf, f"{a}q_a_layernorm.weight")
        out[f"{ap}linear_q_up_proj.weight"] = _heads_from_hf(h.take(hf, f"{a}q_b_proj.weight"), n, dn, dr, il)
    else:
        out[f"{ap}linear_q_proj.weight"] = _heads_from_hf(h.take(hf, f"{a}q_proj.weight"), n, dn, dr, il)
    kv_down = h.take(hf, f"{a}kv_a_proj_with_mqa.weight")
    if il:
        kv_down = torch.cat([kv_down[: cfg.kv_lora_rank], _deinterleave(kv_down[cfg.kv_lora_rank :])], dim=0)
    out[f"{ap}linear_kv_down_proj.weight"] = kv_down
    out[f"{ap}kv_layernorm.weight"] = h.take(hf, f"{a}kv_a_layernorm.weight")
    out[f"{ap}linear_kv_up_proj.weight"] = _heads_from_hf(
        h.take(hf, f"{a}kv_b_proj.weight"), n, dn, dv, False
    )
    out[f"{ap}linear_proj.weight"] = h.take(hf, f"{a}o_proj.weight")
    m, mp = f"{hp}mlp.", f"{lp}mlp."
    if cfg.is_moe_layer(layer_id):
        out[f"{mp}router.weight"] = h.take(hf, f"{m}gate.weight")
        out[f"{mp}router.expert_bias"] = hf.pop(
            f"{m}gate.e_score_correction_bias", torch.zeros(cfg.num_experts)
        )
        h.experts_from_hf(hf, m, mp, cfg.num_experts, out)
        if cfg.shared_expert_intermediate_size:
            h.swiglu_from_hf(hf, f"{m}shared_experts.", f"{mp}shared_experts.", out)
    else:
        h.swiglu_from_hf(hf, m, mp, out)


def _layer_to_hf(sd: dict, hp: str, lp: str, layer_id: int, cfg: TransformerConfig, out: dict) -> None:
    n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    il = _interleaved(cfg)
    a, ap = f"{hp}self_attn.", f"{lp}self_attention."
    h.norms_to_hf(sd, hp, lp, out)
    if cfg.q_lora_rank:
        out[f"{a}q_a_proj.weight"] = sd[f"{ap}linear_q_down_proj.weight"]
        out[f"{a}q_a_layernorm.weight"] = sd[f"{ap}q_layernorm.weight"]
        out[f"{a}q_b_proj.weight"] = _heads_to_hf(sd[f"{ap}linear_q_up_proj.weight"], n, dn, dr, il)
    else:
        out[f"{a}q_proj.weight"] = _heads_to_hf(sd[f"{ap}linear_q_proj.weight"], n, dn, dr, il)
    kv_down = sd[f"{ap}linear_kv_down_proj.weight"]
    if il:
        kv_down = torch.cat([kv_down[: cfg.kv_lora_rank], _interleave(kv_down[cfg.kv_lora_rank :])], dim=0)
    out[f"{a}kv_a_proj_with_mqa.weight"] = kv_down
    out[f"{a}kv_a_layernorm.weight"] = sd[f"{ap}kv_layernorm.weight"]
    out[f"{a}kv_b_proj.weight"] = _heads_to_hf(sd[f"{ap}linear_kv_up_proj.weight"], n, dn, dv, False)
    out[f"{a}o_proj.weight"] = sd[f"{ap}linear_proj.weight"]
    m, mp = f"{hp}mlp.", f"{lp}mlp."
    if cfg.is_moe_layer(layer_id):
        out[f"{m}gate.weight"] = sd[f"{mp}router.weight"]
        out[f"{m}gate.e_score_correction_bias"] = sd[f"{mp}router.expert_bias"]
        h.experts_to_hf(sd, m, mp, out)
        if cfg.shared_expert_intermediate_size:
            h.swiglu_to_hf(sd, f"{m}shared_experts.", f"{mp}shared_experts.", out)
    else:
        h.swiglu_to_hf(sd, m, mp, out)


def from_hf(hf: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_from_hf(hf, cfg, out)
    for i in range(cfg.num_layers):
        _layer_from_hf(hf, h.HF.format(i=i), h.LM.format(i=i), i, cfg, out)
    for k in range(cfg.mtp_num_layers):
        hp, lp, layer_id = h.HF.format(i=cfg.num_layers + k), f"mtp.layers.{k}.", cfg.num_layers + k
        if f"{hp}eh_proj.weight" not in hf:
            _log.warning(
                "%s has no MTP weights; mtp.layers.%d keeps its fresh initialisation", "checkpoint", k
            )
            continue
        for name in ("enorm", "hnorm", "eh_proj"):
            out[f"{lp}{name}.weight"] = h.take(hf, f"{hp}{name}.weight")
        out[f"{lp}final_layernorm.weight"] = h.take(hf, f"{hp}shared_head.norm.weight")
        hf.pop(f"{hp}embed_tokens.weight", None)
        hf.pop(f"{hp}shared_head.head.weight", None)
        _layer_from_hf(hf, hp, f"{lp}transformer_layer.", layer_id, cfg, out)
    return out


def to_hf(sd: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_to_hf(sd, cfg, out)
    for i in range(cfg.num_layers):
        _layer_to_hf(sd, h.HF.format(i=i), h.LM.format(i=i), i, cfg, out)
    head = sd["embedding.word_embeddings.weight"] if cfg.tie_word_embeddings else sd["output_layer.weight"]
    for k in range(cfg.mtp_num_layers):
        hp, lp = h.HF.format(i=cfg.num_layers + k), f"mtp.layers.{k}."
        for name in ("enorm", "hnorm", "eh_proj"):
            out[f"{hp}{name}.weight"] = sd[f"{lp}{name}.weight"]
        out[f"{hp}shared_head.norm.weight"] = sd[f"{lp}final_layernorm.weight"]
        # DeepSeek's checkpoints carry copies of the shared embedding and head in every MTP layer.
        out[f"{hp}embed_tokens.weight"] = sd["embedding.word_embeddings.weight"].clone()
        out[f"{hp}shared_head.head.weight"] = head.clone()
        _layer_to_hf(sd, hp, f"{lp}transformer_layer.", cfg.num_layers + k, cfg, out)
    return out


def hf_config(cfg: TransformerConfig) -> dict:
    first_dense = min(cfg.moe_layers) if cfg.moe_layers else cfg.num_layers
    return {
        **h.base_hf_config(cfg),
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "n_shared_experts": (cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size)
        if cfg.moe_intermediate_size
        else 0,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "first_k_dense_replace": first_dense,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "scoring_func": cfg.score_function,
        "topk_method": "group_limited_greedy" if cfg.group_score == "max" else "noaux_tc",
        "num_nextn_predict_layers": cfg.mtp_num_layers,
        "rope_interleave": _interleaved(cfg),
        "attention_bias": False,
    }
