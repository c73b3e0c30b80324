"""Per-rank memory estimate for ``lmforge check --world-size N`` (no process group needed).

An estimate, not a measurement: parameter counts are exact (taken from the model built on the meta
device); activations use the standard per-layer count for a pre-norm transformer with a fused
(flash-like) attention kernel, ``34·s·b·h`` bytes at 2-byte activations (Korthikanti et al. 2022,
without the ``5·a·s²`` term that SDPA never materialises), split by tp (sequence parallel) and cp.

Storage follows what :func:`lmforge.parallel.parallelize` does: under FSDP (any multi-process run) the
sharded parameters are kept in fp32 and are themselves the master weights, the compute copy of one
layer is gathered in the compute dtype; on one process the parameters are stored in the compute dtype
and the optimizer keeps fp32 masters of bf16/fp16 parameters. Gradients are fp32 either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

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
    master_weights: int
    gathered_parameters: int  # unsharded compute copies FSDP holds during a layer's forward/backward
    activations: int
    activations_recompute: int
    local_parameter_count: int
    notes: list[str] = field(default_factory=list)
    moment_bytes: int = 4  # per optimizer-moment element: 4 (fp32) or 2 (optimizer.moment_dtype: bfloat16)

    def total(self, recompute: bool = False) -> int:
        act = self.activations_recompute if recompute else self.activations
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.master_weights
            + self.gathered_parameters
            + act
        )

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients (fp32)", self.gradients),
            (f"optimizer states ({'fp32' if self.moment_bytes == 4 else 'bf16'})", self.optimizer_states),
            ("fp32 master weights", self.master_weights),
            ("gathered layer parameters", self.gathered_parameters),
            ("activations", self.activations),
            ("activations with full recompute", self.activations_recompute),
            ("total", self.total(False)),
            ("total with full recompute", self.total(True)),
        ]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


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
) -> MemoryEstimate:
    """Estimate what one rank holds when ``model`` (built on meta) is trained with ``dims``."""
    cbytes = _DTYPE_BYTES.get(compute_dtype, 4)
    sharded = dims.is_parallel  # parallelize() applies FSDP (possibly over 1 rank) whenever world > 1
    dense_local = expert_local = 0.0
    muon_local = 0.0
    largest_layer = 0
    per_layer: dict[str, int] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        if _is_expert(name):
            local = n / (dims.pp * dims.tp * dims.ep) / (dims.expert_fsdp_size if sharded else 1)
            expert_local += local
        else:
            local = n / (dims.pp * dims.tp) / (dims.fsdp_size if sharded else 1)
            if not _is_vocab(name) and "layers." not in name:
                local = n / (
                    dims.fsdp_size if sharded else 1
                )  # norms outside the layers: replicated over tp/pp
            dense_local += local
        if p.ndim == 2 and not _is_vocab(name):
            muon_local += local
        if "layers." in name:
            key = name.split("layers.", 1)[1].split(".", 1)[0]
            per_layer[key] = per_layer.get(key, 0) + n
    largest_layer = max(per_layer.values(), default=0)
    local = dense_local + expert_local
    notes: list[str] = []
    if sharded:
        params = int(local * 4)
        masters = 0
        notes.append("FSDP keeps the sharded parameters in fp32; they are the master weights.")
        gathered = int(2 * largest_layer / dims.tp * cbytes)  # the current layer and the prefetched next one
    else:
        params = int(local * cbytes)
        masters = int(local * 4) if cbytes < 4 else 0
        gathered = 0
    grads = int(local * 4)
    opt = optimizer_type.lower()
    if opt == "muon":
        states = int(
            muon_local * moment_bytes + (local - muon_local) * 2 * moment_bytes
        )  # momentum for Muon matrices, Adam moments else
    else:
        states = int(local * 2 * moment_bytes)
    layers_here = -(-num_layers // dims.pp)
    tokens = seq_length * local_batch_size / dims.cp
    per_layer_act = 34 * tokens * hidden_size * (cbytes / 2) / dims.tp
    # 1F1B keeps up to pp micro-batches in flight on the first stage; GPipe keeps all of them.
    in_flight = min(dims.pp, accumulation_steps) if dims.pp > 1 else 1
    logits = tokens * vocab_size / dims.tp * 4 * 2  # fp32 logits and their softmax for the loss
    act = int(layers_here * per_layer_act * in_flight + logits)
    act_rc = int(
        (layers_here * 2 * tokens * hidden_size * cbytes / dims.tp) * in_flight + per_layer_act + logits
    )
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        optimizer_states=states,
        master_weights=masters,
        gathered_parameters=gathered,
        activations=act,
        activations_recompute=act_rc,
        local_parameter_count=int(local),
        notes=notes,
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
