"""``GPTModel``: the decoder-only transformer every family builds, with the hooks optimizers and monitors use.

Module tree (Megatron / MindSpore Transformers names, so YAML name patterns match)::

    embedding.word_embeddings                      [vocab, hidden]
    decoder.layers.N.input_layernorm               RMSNorm
    decoder.layers.N.self_attention.*              the family's attention block (GQA, MLA, ...)
    decoder.layers.N.pre_mlp_layernorm             RMSNorm
    decoder.layers.N.mlp.*                         the family's MLP block (SwiGLU, MoE, ...)
    decoder.final_layernorm                        RMSNorm
    output_layer                                   Linear [vocab, hidden] (absent when embeddings are tied)
    mtp.layers.K.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}   DeepSeek-V3 multi-token prediction
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.models.common import init
from lmforge.models.common.attention import CoreAttention
from lmforge.models.common.blocks import LayerBlocks
from lmforge.models.common.init import draw_seed
from lmforge.models.common.loss import TokenLoss, announced_gradient_scale
from lmforge.models.common.masks import attention_layout
from lmforge.models.common.moe import ExpertWeight, MoELayer, TopKRouter, moe_layers
from lmforge.models.common.norms import RMSNorm
from lmforge.models.common.rope import RotaryEmbedding
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.utils.qk_clip import QKClipLayer


@dataclass
class CausalLMOutput:
    # None when the loss was computed chunk by chunk (model.loss_chunk_size > 0): the logits never exist.
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None  # loss_sum / num_tokens + aux_loss
    loss_sum: torch.Tensor | None = None  # fp32 sum of token cross-entropies over valid tokens
    num_tokens: torch.Tensor | None = None  # number (sum of loss_mask weights) of valid tokens
    aux_loss: torch.Tensor | None = None  # weighted sum of auxiliary losses included in ``loss``
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)  # named values for logging


class TransformerLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_id: int, blocks: LayerBlocks) -> None:
        super().__init__()
        self.layer_id = layer_id
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attention = blocks.attention(cfg, layer_id)
        self.pre_mlp_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = blocks.mlp(cfg, layer_id)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), cos, sin, allowed)
        x = x + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return x + F.dropout(mlp, self.hidden_dropout, self.training)

    def flops_per_token(self, hidden_size: int, seq_length: int) -> float:
        return self.self_attention.flops_per_token(hidden_size, seq_length) + self.mlp.flops_per_token(
            hidden_size
        )


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, blocks: LayerBlocks) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg, i, blocks) for i in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token prediction depth k: [enorm(emb(t+k)); hnorm(h)] → eh_proj → layer → norm."""

    def __init__(self, cfg: TransformerConfig, layer_id: int, blocks: LayerBlocks) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.transformer_layer = TransformerLayer(cfg, layer_id, blocks)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden states, their final norm). One call of the depth, so wrappers of it
        (FSDP's per-layer unshard, tensor-parallel styles) run around all of its parameters."""
        hidden = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        hidden = self.transformer_layer(hidden, cos, sin, allowed)
        return hidden, self.final_layernorm(hidden)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: TransformerConfig, blocks: LayerBlocks) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MTPLayer(cfg, cfg.num_layers + i, blocks) for i in range(cfg.mtp_num_layers)
        )


def _shift_left(t: torch.Tensor, fill: float | int) -> torch.Tensor:
    return torch.cat([t[:, 1:], torch.full_like(t[:, :1], fill)], dim=1)


class GPTModel(nn.Module):
    """A decoder-only causal LM. A family subclasses it to name itself and its layer blocks."""

    # How this family builds a layer's attention and MLP (set by every family's model class).
    blocks: ClassVar[LayerBlocks | None] = None

    def __init__(self, config: TransformerConfig) -> None:
        if self.blocks is None:
            raise TypeError(
                f"{type(self).__name__} must declare its LayerBlocks as the class attribute 'blocks'."
            )
        super().__init__()
        self.config = config
        self.compute_dtype = config.compute_dtype
        self.params_dtype = config.params_dtype
        h = config.hidden_size
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.decoder = TransformerBlock(config, self.blocks)
        self.output_layer = (
            None if config.tie_word_embeddings else nn.Linear(h, config.vocab_size, bias=False)
        )
        rope_dim = config.qk_rope_head_dim if config.multi_latent_attention else config.head_dim
        self.rotary_pos_emb = RotaryEmbedding(
            rope_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.mtp = MultiTokenPrediction(config, self.blocks) if config.mtp_num_layers > 0 else None
        self._track_max_logits = False
        self.token_loss = TokenLoss(config.loss_chunk_size)

    # ---- construction -------------------------------------------------------------------------
    def cast_to_compute_dtype(self) -> GPTModel:
        """Parameters live in compute_dtype (DESIGN §6); routers and their expert bias stay fp32."""
        fp32_keep = {id(t) for m in self.modules() if getattr(m, "keep_fp32", False) for t in m.parameters()}
        fp32_keep |= {id(t) for m in self.modules() if getattr(m, "keep_fp32", False) for t in m.buffers()}
        for module in self.modules():
            for _name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in fp32_keep and p.dtype != self.compute_dtype:
                    p.data = p.data.to(self.compute_dtype)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer in place (after ``to_empty`` when built on meta).

        Matrices (linear, embedding, expert and router weights) ~ N(0, initializer_range²), biases 0,
        norm gains 1, expert bias 0; RoPE frequencies are recomputed. The matrices are drawn layout-
        invariantly (:mod:`lmforge.models.common.init`): the same ``seed`` gives the same values on one
        process and on every sharded layout. Without ``seed``, one is drawn from torch's global RNG.
        """
        seed = draw_seed() if seed is None else int(seed)
        std = self.config.initializer_range
        # Fused weights are drawn in their logical row order ([Q; K; V], [gate; up], MLA parts grouped):
        # a seed gives the same model as before their storage layout changed, and as Hugging Face's split.
        fused = {
            f"{prefix}.{child}" if prefix else child: rows
            for prefix, module in self.named_modules()
            if callable(getattr(module, "layout_v1_rows", None))
            for child, rows in module.layout_v1_rows().items()
        }
        for prefix, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding, ExpertWeight, TopKRouter)):
                init.normal_(module.weight, f"{prefix}.weight", seed, std, fused.get(prefix))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if getattr(module, "expert_bias", None) is not None:
                    module.expert_bias.zero_()
            elif isinstance(module, (RMSNorm, RotaryEmbedding, CoreAttention)):
                module.reset_parameters()
            elif isinstance(module, MoELayer):
                module.tokens_per_expert.zero_()
                module.bias_update_counts.zero_()

    # ---- forward ------------------------------------------------------------------------------
    def _stored_output_weight(self) -> torch.Tensor | None:
        """The output weight as stored (the embedding's when tied): a plain tensor, or a DTensor, e.g. split
        by vocabulary rows under tensor parallel; None on a pipeline stage that holds neither."""
        if self.output_layer is not None:
            return self.output_layer.weight
        emb = getattr(self.embedding, "word_embeddings", None) if self.embedding is not None else None
        return emb.weight if emb is not None else None

    def _output_weight(self) -> torch.Tensor:
        """The whole output weight (a DTensor is gathered; its gradient goes back to this rank's rows)."""
        w = self._stored_output_weight()
        return w.full_tensor() if isinstance(w, DTensor) else w

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        actual_seq_len: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        b, s = input_ids.shape
        device = input_ids.device
        if position_ids is None:  # positions 0..S-1 in every row: cached [1, S, D] tables
            cos, sin = self.rotary_pos_emb.table(s, device)
        else:
            cos, sin = self.rotary_pos_emb(position_ids[None] if position_ids.dim() == 1 else position_ids)
        allowed = attention_layout(s, device, attention_mask, actual_seq_len)

        hidden = self.embedding.word_embeddings(input_ids)
        for layer in self.decoder.layers:
            hidden = layer(hidden, cos, sin, allowed)
        normed = self.decoder.final_layernorm(hidden)
        if labels is None:
            return CausalLMOutput(logits=F.linear(normed, self._output_weight()))
        out = CausalLMOutput(logits=None)
        # The main loss only: the train step announces the gradient of this sum (MTP sums get others).
        loss_sum, num_tokens, out.logits = self._token_loss(
            normed, labels, loss_mask, announced_gradient_scale()
        )
        aux_total = loss_sum.new_zeros(())
        aux_losses: dict[str, torch.Tensor] = {}
        if self.mtp is not None:
            aux_total = aux_total + self.mtp_losses(
                hidden, input_ids, labels, loss_mask, cos, sin, allowed, aux_losses
            )
        balance = [m.last_aux_loss for m in moe_layers(self) if m.last_aux_loss is not None]
        if balance:
            aux_losses["load_balancing_loss"] = torch.stack(balance).sum()
            aux_total = aux_total + aux_losses["load_balancing_loss"]
        out.loss_sum, out.num_tokens = loss_sum, num_tokens
        out.aux_loss, out.aux_losses = aux_total, aux_losses
        out.loss = loss_sum / num_tokens.clamp(min=1) + aux_total
        return out

    def _token_loss(
        self,
        normed: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        grad_scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(CE sum, valid tokens, logits or None) through ``self.token_loss`` with the stored output weight;
        ``grad_scale``: the gradient the sum will get in backward, if known (the chunked loss folds it in)."""
        return self.token_loss(
            normed,
            self._stored_output_weight(),
            labels,
            loss_mask,
            **self.token_loss.grad_scale_kwargs(grad_scale),
        )

    def mtp_losses(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed,
        aux_losses: dict[str, torch.Tensor],
        *,
        embed=None,
        output_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Depth k predicts labels[t+k] from hidden state t of depth k-1 and the embedding of input t+k.

        The rolled-in tail positions are masked. Adds ``mtp_k_loss`` (plain mean CE) to ``aux_losses``
        and returns ``mtp_loss_scaling_factor / D · Σ_k mtp_k_loss``. ``embed`` (ids → embeddings) and
        ``output_weight`` default to this model's embedding and output weight; a pipeline's last stage,
        which holds neither the embedding nor (when tied) the output weight, passes its own.
        """
        embed = self.embedding.word_embeddings if embed is None else embed
        weight = self._stored_output_weight() if output_weight is None else output_weight
        ids, lab = input_ids, labels
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        total = hidden.new_zeros((), dtype=torch.float32)
        depth = len(self.mtp.layers)
        for k, mtp in enumerate(self.mtp.layers, start=1):
            ids, lab, mask = _shift_left(ids, 0), _shift_left(lab, -100), _shift_left(mask, 0.0)
            hidden, normed = mtp(hidden, embed(ids), cos, sin, allowed)
            lsum, n, _ = self.token_loss(normed, weight, lab, mask)
            loss_k = lsum / n.clamp(min=1)
            aux_losses[f"mtp_{k}_loss"] = loss_k
            total = total + loss_k
        return total * (self.config.mtp_loss_scaling_factor / depth)

    # ---- hooks for optimizers, monitors and MFU -----------------------------------------------
    def no_weight_decay_names(self) -> set[str]:
        """Norm gains and biases (1-D parameters); routers' expert bias is a buffer, not a parameter."""
        return {name for name, p in self.named_parameters() if p.dim() < 2}

    def _blocks(self, part: str) -> list[tuple[str, nn.Module]]:
        """(name, block) of every layer's ``self_attention`` or ``mlp``, whatever class the family built."""
        return [
            (f"{name}.{part}", getattr(m, part))
            for name, m in self.named_modules()
            if isinstance(m, TransformerLayer)
        ]

    def _attention_modules(self) -> list[tuple[str, nn.Module]]:
        # An attention block takes part in QK-Clip and max-logit tracking by giving the optional hook
        # ``qk_clip_layer(prefix)`` over a ``core_attention`` (CoreAttention), as GQA and MLA do.
        return [
            (name, m)
            for name, m in self._blocks("self_attention")
            if callable(getattr(m, "qk_clip_layer", None))
        ]

    def muon_split_schema(self) -> dict[str, tuple[int, list[int]]]:
        """Each block's optional ``muon_split_schema(prefix)`` (fused weights and their pieces)."""
        schema: dict[str, tuple[int, list[int]]] = {}
        for name, m in [*self._blocks("self_attention"), *self._blocks("mlp")]:
            hook = getattr(m, "muon_split_schema", None)
            if hook is not None:
                schema.update(hook(name))
        return schema

    def qk_clip_layers(self) -> list[QKClipLayer]:
        return [m.qk_clip_layer(name) for name, m in self._attention_modules()]

    @property
    def track_max_logits(self) -> bool:
        return self._track_max_logits

    @track_max_logits.setter
    def track_max_logits(self, value: bool) -> None:
        self._track_max_logits = bool(value)
        for _, m in self._attention_modules():
            m.core_attention.track_max_logits = bool(value)

    def reset_max_logits(self) -> None:
        for _, m in self._attention_modules():
            m.core_attention.max_logits.zero_()

    def _moe_layers(self) -> dict[int, MoELayer]:
        found = {}
        for layer in self.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                found[layer.layer_id] = layer.mlp
        if self.mtp is not None:
            for mtp in self.mtp.layers:
                if isinstance(mtp.transformer_layer.mlp, MoELayer):
                    found[mtp.transformer_layer.layer_id] = mtp.transformer_layer.mlp
        return found

    def tokens_per_expert(self) -> dict[int, torch.Tensor]:
        """Layer id (MTP layers continue after the decoder's) → tokens routed per expert since the last reset."""
        return {i: m.tokens_per_expert.clone() for i, m in self._moe_layers().items()}

    def reset_tokens_per_expert(self) -> None:
        for m in self._moe_layers().values():
            m.tokens_per_expert.zero_()

    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step, once per optimizer step. Each MoE layer sums its counts over the
        ranks that routed other tokens (its ``bias_counts_group``, set by ``parallelize``), so every
        replica applies the same update."""
        for m in self._moe_layers().values():
            m.update_expert_bias()

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token: 3 × the forward matmul FLOPs (backward = 2 × forward).

        Forward counts every matmul (2 FLOPs per multiply-add) with active experts only, the router,
        attention scores and values over the full ``seq_length`` (no causal halving, as in PaLM's MFU),
        the output layer, and the MTP depths. Embedding lookups, norms, softmax and RoPE are not counted.
        """
        s = seq_length or self.config.seq_length
        h, v = self.config.hidden_size, self.config.vocab_size
        fwd = sum(layer.flops_per_token(h, s) for layer in self.decoder.layers) + 2 * h * v
        if self.mtp is not None:
            for mtp in self.mtp.layers:
                fwd += 2 * 2 * h * h + mtp.transformer_layer.flops_per_token(h, s) + 2 * h * v
        return 3.0 * fwd
