"""Per-rank memory estimate for ``lmforge check --world-size N`` (no process group needed).

An estimate, checked against measurements: parameter counts are exact (taken from the model built on
the meta device). Activations are counted per token and layer from the model's dimensions with the
coefficients of lmforge's own layers (:func:`layer_activation_bytes_per_token`: what autograd saves
in a Qwen3/Llama-style layer, measured with ``count_saved_activation_bytes`` while varying each
dimension), split by tp (sequence parallel) and cp. The peak is the largest of four moments of a step:
the start of backward (every saved activation plus the logits' gradient), the MLP backward of the
stage's last layer (every saved activation plus that MLP's gradients and what the loss left), with
recompute a layer's backward (the gradients plus the kept layer inputs and one recomputed layer's
activations) and the optimizer step (all gradients).
tests/tools compares the result with the measured peak of real CPU steps (docs/guide.md).

Storage follows what :func:`lmforge.parallel.parallelize` does on every world size, one process
included: FSDP2 keeps the sharded parameters in fp32 (they are the master weights) and gathers the
compute copy of a layer in the compute dtype. Gradients are fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmforge.config.sections_parallel import RecomputeConfig
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.parallel import fsdp
from lmforge.parallel.dims import ParallelDims

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


def _is_expert(name: str) -> bool:
    return ".experts." in name and "shared_expert" not in name


def _is_vocab(name: str) -> bool:
    return "word_embeddings" in name or name.startswith("output_layer")


@dataclass
class MemoryEstimate:
    """Bytes per rank, for the most loaded rank (first pipeline stage for activations)."""

    parameters: int
    gradients: int
    optimizer_states: int
    gathered_parameters: int  # unsharded compute copies FSDP holds during a layer's forward/backward
    activations: int
    activations_recompute: int
    local_parameter_count: int
    notes: list[str] = field(default_factory=list)
    # With full recompute, a layer's backward holds the gradients, the kept layer inputs and one
    # recomputed layer's activations at once.
    recompute_backward: int = 0
    # Without full recompute, the MLP backward of the stage's last layer (the first layer backward
    # reaches): every saved activation, that MLP's gradients and what the loss left behind. With the
    # chunked loss this moment, not the loss, is the peak when the MLP is wide next to one chunk's logits.
    mlp_backward: int = 0
    # Gradient accumulation: later micro-batches run their forward with every gradient allocated.
    gradients_during_forward: bool = False
    # One rank computing in 16 bits groups layers into larger FSDP units (parallel/fsdp.py): the largest
    # unit's 16-bit gradients are alive beside the fp32 ones at its reduction, at the end of backward.
    unit_gradients: int = 0
    moment_bytes: int = 4  # per optimizer-moment element: 4 (fp32) or 2 (optimizer.moment_dtype: bfloat16)

    def total(self, recompute: bool = False) -> int:
        """The peak: the largest of the start of backward, the last layer's MLP backward (without full
        recompute), a recomputed layer's backward and the end of backward (all gradients allocated,
        the activations and, once resharded, the compute copies freed; the last FSDP unit's 16-bit
        gradients are being turned into fp32 ones there; the optimizer step holds the same without them)."""
        act = self.activations_recompute if recompute else self.activations
        held_grads = self.gradients if self.gradients_during_forward else 0
        during = act + held_grads
        if recompute:
            during = max(during, self.gradients + self.recompute_backward)
        else:
            during = max(during, self.mlp_backward + held_grads)
        after = self.gradients + self.unit_gradients
        return self.parameters + self.optimizer_states + max(self.gathered_parameters + during, after)

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients (fp32)", self.gradients),
            *(
                [("16-bit gradients of the largest FSDP unit", self.unit_gradients)]
                if self.unit_gradients
                else []
            ),
            (f"optimizer states ({'fp32' if self.moment_bytes == 4 else 'bf16'})", self.optimizer_states),
            ("gathered layer parameters", self.gathered_parameters),
            ("activations", self.activations),
            ("activations with full recompute", self.activations_recompute),
            ("total", self.total(False)),
            ("total with full recompute", self.total(True)),
        ]


# Bytes per token outside the layers that no dimension explains (labels, masks, loss bookkeeping).
_REST_CONST = 536


def _mtp_activation_bytes(
    config: TransformerConfig,
    per_layer_act: float,
    tokens: float,
    hidden_size: int,
    cbytes: int,
    dims: ParallelDims,
) -> tuple[float, float]:
    """(activations, what full recompute keeps) of the multi-token-prediction depths, which all run on the
    last pipeline stage: each a layer's activations plus its input projection's (the two normed halves,
    their concatenation and the projected hidden states: ~6 hidden-sized tensors per token); with full
    recompute, each depth's two inputs and its output."""
    depths = getattr(config, "mtp_num_layers", 0) if isinstance(config, TransformerConfig) else 0
    per_token = tokens * hidden_size * cbytes / dims.tp
    return depths * (per_layer_act + 6 * per_token), depths * 3 * per_token


def layer_activation_parts_per_token(
    config: TransformerConfig, hidden_size: int, cbytes: int
) -> dict[str, float]:
    """The attention and MLP shares of :func:`layer_activation_bytes_per_token` (what recomputing the
    whole ``self_attention`` or ``mlp`` module of a layer frees: its input is the norm's output, which
    the layer keeps anyway)."""
    parts: dict[str, float] = {}
    layer_activation_bytes_per_token(config, hidden_size, cbytes, parts)
    return parts


def selected_recompute_parts(
    model: nn.Module, recompute_section: RecomputeConfig | None, num_layers: int
) -> dict[int, set[str]]:
    """Which whole modules ``recompute.mode: select`` recomputes, per layer id: ``{"attention", "mlp"}``.

    Resolves the patterns with the code training uses (on ``model``, normally built on meta; its
    modules get wrapped). A layer of ``full_recompute_layer`` counts as both; a selected submodule
    smaller than the whole attention or MLP frees an unknown part and counts as nothing (the
    estimate stays on the high side).
    """
    from lmforge.parallel.activation import plan_activation_memory

    if recompute_section is None or recompute_section.mode != "select":
        return {}
    plan = plan_activation_memory(model, recompute_section, None, None, num_layers)
    out: dict[int, set[str]] = {i: {"attention", "mlp"} for i in plan.full_layers}
    whole = {"self_attention": "attention", "mlp": "mlp"}
    for path in plan.selected_paths:
        if "layers." not in path:
            continue
        layer, _, rel = path.rsplit("layers.", 1)[1].partition(".")
        if layer.isdigit() and rel in whole:
            out.setdefault(int(layer), set()).add(whole[rel])
    return out


def layer_activation_bytes_per_token(
    config: TransformerConfig, hidden_size: int, cbytes: int, parts: dict[str, float] | None = None
) -> float:
    """Bytes one decoder layer saves for backward per token (no tp/cp split), from its dimensions.

    Coefficients measured on lmforge's layers by varying one dimension at a time (fp32 / bf16):
    hidden ``4c + 8`` bytes per unit (norm inputs and outputs, residual; 16-bit runs keep fp32 norm
    copies), attention ``4c`` per query and per key/value unit (+4 in 16-bit: the qk-norm's fp32 copy)
    plus 8 bytes per query head and 4 per key/value head (fp32 log-sum-exp, norm statistics), dense
    MLP ``4c`` per intermediate unit (fused gate/up output, SiLU output, product); a routed MoE MLP
    ``k·(3.5·hidden + 7·moe_intermediate)·c`` plus the fp32 router (8 bytes per expert, 12 per hidden
    unit in 16-bit). ``config`` is the model's typed ``TransformerConfig`` (every family builds one); a
    dimension it lacks is an error, not a guess.
    """
    _require_dimensions(config)
    parts = {} if parts is None else parts
    c = cbytes
    h = hidden_size
    low = c < 4
    heads = config.num_attention_heads
    if config.multi_latent_attention:
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        q_dim = heads * (nope + rope)
        kv_dim = (heads * (nope + config.v_head_dim) + config.kv_lora_rank + rope) / 2
        kv_heads = heads
    else:
        kv_heads, head_dim = config.num_key_value_heads, config.head_dim
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attention = q_dim * (4 * c + 4 * low) + kv_dim * (4 * c + 4 * low) + 8 * heads + 4 * kv_heads
    hidden = h * (4 * c + 8)
    parts["attention"] = attention
    dense_mlp = 4 * c * config.intermediate_size
    num_layers = config.num_layers
    moe_layers = len(config.moe_layers) if config.num_experts else 0
    if moe_layers:
        k, f, e = config.num_experts_per_tok, config.moe_intermediate_size, config.num_experts
        moe_mlp = k * (3.5 * h + 7 * f) * c + 8 * e + 12 * h * low
        if config.shared_expert_intermediate_size:
            moe_mlp += 4 * c * config.shared_expert_intermediate_size
        # The average over the layers (the stage estimate multiplies by the layer count).
        mlp = (moe_layers * moe_mlp + (num_layers - moe_layers) * dense_mlp) / num_layers
    else:
        mlp = dense_mlp
    parts["mlp"] = mlp
    return hidden + attention + mlp


def mlp_backward_bytes(
    config: TransformerConfig, layer_id: int, tokens: float, hidden_size: int, cbytes: int, dims: Any
) -> float:
    """The gradients alive in the MLP backward of layer ``layer_id`` (``tokens``: the MLP's input rows on
    this rank; its intermediate width is split by tp), measured at the SiLU·up product's backward: the
    gradients of its three ``[tokens, ffn]`` intermediates (the product, the SiLU output, the up half)
    and the second projection's unsharded weight gradient, all in the compute dtype. A routed MoE layer
    has them per token copy (``k`` rows a token) and for this rank's experts at once (one batched
    matmul); its shared expert runs before or after and counts as a dense MLP of its own width."""
    c = cbytes
    if config.is_moe_layer(layer_id):
        k, f = config.num_experts_per_tok, config.moe_intermediate_size / dims.tp
        local_experts = config.num_experts / dims.ep
        routed = 3 * k * tokens * f * c + local_experts * hidden_size * f * c
        shared = config.shared_expert_intermediate_size / dims.tp
        return max(routed, 3 * tokens * shared * c + hidden_size * shared * c)
    f = config.intermediate_size / dims.tp
    return 3 * tokens * f * c + hidden_size * f * c


def _require_dimensions(config: object) -> None:
    """The activation estimate reads these facts of the model's ``TransformerConfig``; a model without one,
    or a family that leaves one unset, is refused rather than estimated with a made-up value."""
    if not isinstance(config, TransformerConfig):
        raise TypeError(
            f"the memory estimate needs an lmforge model with a TransformerConfig (model.config), got "
            f"{type(config).__name__}; build the model with lmforge.models.build_model."
        )
    names = ["num_layers", "num_attention_heads"]
    if config.multi_latent_attention:
        names += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    else:
        names += ["num_key_value_heads", "head_dim"]
    moe_layers = len(config.moe_layers) if config.num_experts else 0
    if moe_layers:
        names += ["num_experts_per_tok", "moe_intermediate_size"]
    if moe_layers < config.num_layers:
        names.append("intermediate_size")  # the dense MLP layers
    missing = [n for n in names if not getattr(config, n) > 0]
    if missing:
        raise ValueError(
            f"model_type {config.model_type!r}: the memory estimate needs {', '.join(missing)} of its "
            "TransformerConfig (positive); its family's to_transformer_config left them unset."
        )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


@dataclass
class _ParameterShares:
    """What one rank holds of the model's parameters (element counts, fractional under sharding)."""

    dense: float = 0.0
    experts: float = 0.0
    muon_matrices: float = 0.0  # the 2-D non-vocabulary parameters (Muon's momentum only)
    largest_layer: int = 0  # elements of the largest decoder layer, unsharded
    outside_layers: int = 0  # elements outside the decoder layers, unsharded
    per_layer: list[float] = field(default_factory=list)  # per layer (in order), one rank of its stage

    @property
    def local(self) -> float:
        return self.dense + self.experts


def _parameter_shares(model: nn.Module, dims: ParallelDims) -> _ParameterShares:
    shares = _ParameterShares()
    per_layer: dict[str, int] = {}
    layer_local: dict[str, float] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        if "layers." in name:
            owner, rest = name.split("layers.", 1)
            key = owner + rest.split(".", 1)[0]
            share = dims.tp * (dims.ep * dims.expert_fsdp_size if _is_expert(name) else dims.fsdp_size)
            layer_local[key] = layer_local.get(key, 0.0) + n / share
        # The MTP layers all live on the last pipeline stage (parallel/pp.py), the others spread over pp.
        pp_share = 1 if name.startswith("mtp.") else dims.pp
        if _is_expert(name):
            local = n / (pp_share * dims.tp * dims.ep) / dims.expert_fsdp_size
            shares.experts += local
        else:
            local = n / (pp_share * dims.tp) / dims.fsdp_size
            if not _is_vocab(name) and "layers." not in name:
                local = n / dims.fsdp_size  # norms outside the layers: replicated over tp/pp
            shares.dense += local
        if p.ndim == 2 and not _is_vocab(name):
            shares.muon_matrices += local
        if "layers." in name:
            key = name.split("layers.", 1)[1].split(".", 1)[0]
            per_layer[key] = per_layer.get(key, 0) + n
        else:
            shares.outside_layers += n
    shares.largest_layer = max(per_layer.values(), default=0)
    shares.per_layer = list(layer_local.values())
    return shares


def _fsdp_bytes(
    shares: _ParameterShares, dims: ParallelDims, cbytes: int, num_layers: int
) -> tuple[int, int]:
    """(gathered compute copies, 16-bit gradients of the largest FSDP unit) on one rank."""
    local = shares.local
    # The current layer and the prefetched next one, plus the root unit (embedding, output layer,
    # final norm: a stage's share under pp), which FSDP keeps gathered from forward to backward.
    gathered = int((2 * shares.largest_layer + shares.outside_layers / dims.pp) / dims.tp * cbytes)
    if dims.fsdp_size != 1 or cbytes >= 4:
        return gathered, 0
    # A shard group of one computing in 16 bits keeps every layer's compute copy from forward to
    # backward (parallel/fsdp.py), and groups layers into the units parallel/fsdp.py forms there: the
    # whole model when it is within the bound, otherwise runs of consecutive layers (this stage's, under pp).
    gathered = int(local * cbytes)
    sizes = shares.per_layer
    if dims.pp > 1:
        sizes = sizes[: -(-num_layers // dims.pp)]
    limit = fsdp.ONE_RANK_UNIT_PARAMS
    if local <= limit:
        return gathered, int(local * cbytes)
    if sizes:
        return gathered, int(
            max(sum(sizes[i] for i in run) for run in fsdp.group_sizes(sizes, limit)) * cbytes
        )
    return gathered, 0


def _optimizer_state_bytes(optimizer_type: str, shares: _ParameterShares, moment_bytes: int) -> int:
    opt = optimizer_type.lower()
    local = shares.local
    if opt == "muon":
        # momentum for Muon matrices, Adam's two moments for the rest
        return int(shares.muon_matrices * moment_bytes + (local - shares.muon_matrices) * 2 * moment_bytes)
    if opt == "lion":
        return int(local * moment_bytes)  # one momentum
    return int(local * 2 * moment_bytes)


@dataclass
class _StepShape:
    """The facts of one step on one rank that the activation and loss estimates share."""

    config: Any
    dims: ParallelDims
    cbytes: int
    hidden_size: int
    vocab_size: int
    num_layers: int
    tokens: float  # this rank's tokens of one micro-batch (the sequence split by cp)
    accumulation_steps: int

    @property
    def layers_here(self) -> int:
        return -(-self.num_layers // self.dims.pp)

    @property
    def chunk(self) -> int:
        return self.config.loss_chunk_size if isinstance(self.config, TransformerConfig) else 0


def _loss_bytes(shape: _StepShape, notes: list[str]) -> tuple[float, float, float]:
    """(what stays outside the layers until backward, the loss backward's peak, what the loss leaves to
    the MLP backward of the last layer)."""
    tokens, h, c, vocab, dims = shape.tokens, shape.hidden_size, shape.cbytes, shape.vocab_size, shape.dims
    chunk = shape.chunk
    # The plain path's logits live to the end of the step on one process (the model returns them with the
    # loss); the pipeline's last stage returns only the loss, so there they are freed after its forward.
    logits_kept = dims.pp == 1
    if chunk > 0:
        # The chunked loss (models/common/loss.py; under pp the last stage's, per micro-batch): no logits
        # are saved. Its forward holds one chunk's logits over this rank's vocabulary rows, two buffers at
        # most at once in 16 bits (the fp32 copy, turned into the softmax in place, beside the 16-bit
        # logits it is made from or the 16-bit gradient made from it; measured on 2 ranks); in fp32 one
        # buffer serves all three. It keeps the hidden states' gradient and the output weight's
        # gradient until backward. The train step announces the loss's gradient scale, so a 16-bit
        # weight's gradient is summed in 16 bits over one or two chunks and in fp32 over more, rounded
        # to 16 bits at the end of forward, when the fp32 sum and its copy meet (the chunks' logits are
        # freed by then).
        rest = tokens * (h * (2 * c + 4) + _REST_CONST)
        vocab_here = vocab / dims.tp
        chunk_bytes = 4 if c >= 4 else 4 + c
        weight_grad = vocab_here * h
        if c < 4 and math.ceil(tokens / chunk) <= 2:
            chunks, sum_bytes = min(chunk, tokens) * vocab_here * chunk_bytes, weight_grad * c
        elif c < 4:
            chunks = max(min(chunk, tokens) * vocab_here * chunk_bytes, weight_grad * c)
            sum_bytes = weight_grad * 4
        else:
            chunks, sum_bytes = min(chunk, tokens) * vocab_here * chunk_bytes, weight_grad * 4
        logits_grad = chunks + tokens * h * c + sum_bytes
        notes.append(f"chunked loss ({chunk} tokens per chunk): the [tokens, vocab] logits never exist")
        # The output weight's unsharded gradient in the compute dtype (FSDP reduces the root unit only
        # after the embedding's backward).
        return rest, logits_grad, vocab / dims.tp * h * c
    # Outside the layers: embedding output, final norm (2 copies in 16-bit), and the logits themselves in
    # the compute dtype where the step returns them (they live to the end). Under tp the plain loss path
    # gathers the final norm's output and the output weight, so every tp rank computes the
    # full-vocabulary logits (sequence and vocabulary unsplit).
    kept = c * vocab if logits_kept else 0
    rest = tokens * (h * (2 * c + 4) + kept + _REST_CONST)
    # The loss backward's first step, its peak: three fp32 logits-sized tensors (the log-softmax saved
    # for backward, the gradient coming into it and the one it returns). The output weight's gradient
    # comes after they are freed (the MLP-backward moment counts it: the gathered weight's gradient and
    # the logits the step returns).
    logits_grad = tokens * vocab * 4 * 3
    return rest, logits_grad, ((tokens if logits_kept else 0) + h) * vocab * c


def _activation_bytes(
    shape: _StepShape, recompute_select: dict[int, set[str]] | None, notes: list[str]
) -> tuple[int, int, int, int]:
    """(activations, with full recompute, a recomputed layer's backward, the last layer's MLP backward)
    of the most loaded pipeline stage."""
    config, dims, c, h, tokens = shape.config, shape.dims, shape.cbytes, shape.hidden_size, shape.tokens
    num_layers, layers_here = shape.num_layers, shape.layers_here
    per_layer_act = layer_activation_bytes_per_token(config, h, c) * tokens / dims.tp
    mtp_act, mtp_inputs = _mtp_activation_bytes(config, per_layer_act, tokens, h, c, dims)
    rest, logits_grad, loss_left = _loss_bytes(shape, notes)
    # 1F1B keeps up to pp micro-batches in flight on the first stage; GPipe keeps all of them.
    in_flight = min(dims.pp, shape.accumulation_steps) if dims.pp > 1 else 1
    layer_inputs = layers_here * tokens * h * c / dims.tp  # what full recompute keeps
    stage_layers_act = layers_here * per_layer_act
    recomputed_last_mlp = 0.0
    if recompute_select:
        # The selected modules keep only their input (already counted as the norm's output). Under
        # pipeline parallelism the stage with the most selected layers is not known here: count the
        # smallest saving a stage can have (the selected layers spread evenly).
        part = layer_activation_parts_per_token(config, h, c)
        freed = sum(part[name] for names in recompute_select.values() for name in names)
        stage_layers_act -= freed / dims.pp * tokens / dims.tp
        notes.append("recompute select: the selected attention / MLP modules' activations are not kept")
        if dims.pp == 1 and "mlp" in recompute_select.get(num_layers - 1, ()):
            # its backward runs the MLP's forward again first: its activations are back
            recomputed_last_mlp = part["mlp"] * tokens / dims.tp
    # The MLP backward of the stage's last layer, the first layer backward reaches (the peak of the 2-rank
    # FSDP steps with the chunked loss in tests/tools, where one chunk's logits are smaller than the
    # MLP's gradients). Alive then, besides every saved activation: the MLP's gradients
    # (:func:`mlp_backward_bytes`; its input rows are the whole local sequence, gathered under sequence
    # parallel) and what the loss left (:func:`_loss_bytes`). Outside the layers the final norm's saved
    # tensors are gone; the embedding output and the hidden states' gradient (compute dtype) remain.
    rest_in_backward = tokens * (2 * h * c + _REST_CONST)
    mlp_grads_last = mlp_backward_bytes(config, num_layers - 1, tokens, h, c, dims)
    last_stage = (
        stage_layers_act + mtp_act + recomputed_last_mlp + rest_in_backward + loss_left + mlp_grads_last
    )
    if dims.pp == 1:
        return (
            int(stage_layers_act + mtp_act + rest + logits_grad),
            int(layer_inputs + mtp_inputs + rest + logits_grad),
            int(layer_inputs + per_layer_act + rest),
            int(last_stage),
        )
    # The first stage keeps ``in_flight`` micro-batches of its layers; the last stage one micro-batch
    # plus the loss. The larger of the two.
    first_stage_last = min(layers_here, num_layers) - 1
    first_stage = stage_layers_act * in_flight + mlp_backward_bytes(
        config, first_stage_last, tokens, h, c, dims
    )
    return (
        int(max(stage_layers_act * in_flight, stage_layers_act + mtp_act + rest + logits_grad)),
        int(max(layer_inputs * in_flight, layer_inputs + mtp_inputs + rest + logits_grad)),
        int(max(layer_inputs * in_flight, layer_inputs + rest) + per_layer_act),
        int(max(first_stage, last_stage)),
    )


def estimate_memory(
    model: nn.Module,
    dims: ParallelDims,
    *,
    compute_dtype: torch.dtype,
    optimizer_type: str,
    seq_length: int,
    local_batch_size: int,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    accumulation_steps: int = 1,
    moment_bytes: int = 4,
    offload_states: bool = False,
    recompute_select: dict[int, set[str]] | None = None,
) -> MemoryEstimate:
    """Estimate what one rank holds when ``model`` (built on meta) is trained with ``dims``.

    ``moment_bytes``: bytes per optimizer-moment element (2 with ``optimizer.moment_dtype: bfloat16``).
    ``offload_states``: the optimizer keeps its states in CPU memory (``optimizer.offload_states``, FSDP2's
    CPU offload), so they leave the device's count (the offloaded fp32 parameters and gradients are
    still counted: a conservative figure).
    ``recompute_select``: per layer id, the modules ``recompute.mode: select`` recomputes
    (:func:`selected_recompute_parts`); their activations leave ``activations`` (the figure
    ``total(recompute=False)`` uses).
    """
    cbytes = _DTYPE_BYTES.get(compute_dtype, 4)
    notes = ["FSDP2 keeps the (sharded) parameters in fp32; they are the master weights."]
    shares = _parameter_shares(model, dims)
    gathered, unit_grads = _fsdp_bytes(shares, dims, cbytes, num_layers)
    states = _optimizer_state_bytes(optimizer_type, shares, moment_bytes)
    if offload_states:
        notes.append("optimizer states are in CPU memory (optimizer.offload_states)")
        states = 0
    shape = _StepShape(
        config=getattr(model, "config", None),  # checked (with a clear error) by the per-token estimate
        dims=dims,
        cbytes=cbytes,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_layers=num_layers,
        tokens=seq_length * local_batch_size / dims.cp,
        accumulation_steps=accumulation_steps,
    )
    act, act_rc, recompute_backward, mlp_backward = _activation_bytes(shape, recompute_select, notes)
    if accumulation_steps > 1:
        notes.append("gradients stay allocated while later micro-batches run (gradient accumulation)")
    return MemoryEstimate(
        parameters=int(shares.local * 4),
        gradients=int(shares.local * 4),
        optimizer_states=states,
        gathered_parameters=gathered,
        activations=act,
        activations_recompute=act_rc,
        local_parameter_count=int(shares.local),
        notes=notes,
        recompute_backward=recompute_backward,
        mlp_backward=mlp_backward,
        gradients_during_forward=accumulation_steps > 1,
        unit_gradients=unit_grads,
        moment_bytes=moment_bytes,
    )


def describe_ranks(dims: ParallelDims) -> list[str]:
    """One line per rank: its coordinate in every mesh dimension (what data and which shard it holds)."""
    lines = []
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    sizes = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    for rank in range(dims.world_size):
        coords = []
        rest = rank
        for size in reversed(sizes):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        c = dict(zip(names, coords))
        dp_rank = c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
        text = (
            f"rank {rank}: pp stage {c['pp']}, data shard {dp_rank}/{dims.dp}, FSDP shard "
            f"{c['dp_shard'] * dims.cp + c['cp']}/{dims.fsdp_size}"
        )
        if dims.dp_replicate > 1:
            text += f" (replica {c['dp_replicate']}/{dims.dp_replicate})"
        if dims.cp > 1:
            text += f", sequence chunk pair {c['cp']}/{dims.cp}"
        if dims.tp > 1:
            text += f", tensor shard {c['tp']}/{dims.tp}"
        if dims.ep > 1:
            ep_rank = (c["dp_shard"] * dims.cp + c["cp"]) % dims.ep
            text += f", experts group {ep_rank}/{dims.ep}"
        lines.append(text)
    return lines
