"""``lmforge plan``: the layouts that fit a number of GPUs, ranked by an estimated step time.

Memory per GPU comes from :func:`lmforge.tools.memory.estimate_memory` (the code ``lmforge check``
prints). The step time is a model, not a measurement:

* compute: the model's training FLOPs per token (``flops_per_token``, active experts only) times the
  global batch's tokens, over the GPUs' ``gpu_tflops`` at ``efficiency`` (default 0.5 — the MFU a
  well-tuned dense run reaches); full recompute adds one forward (x 4/3);
* communication per GPU per step (:func:`communication_volume`, bytes): FSDP all-gathers parameters
  twice (forward, backward) in the compute dtype and reduce-scatters fp32 gradients; HSDP adds an
  all-reduce of the gradient shard across replicas; tensor parallel (with sequence parallel) moves
  8 activation tensors per layer per micro-batch; expert parallel 4 all-to-alls of the routed tokens
  per MoE layer; context parallel passes the keys/values around the ring (forward and backward);
  pipeline parallel sends one activation per micro-batch per stage boundary each way, and with tied
  embeddings or MTP the embedding weight to the last stage and its gradient back (fp32);
* bandwidths (overridable): groups inside a node use ``intra_node_gbps`` (default 200 GB/s per GPU,
  NVLink-class effective bus bandwidth), groups that span nodes ``inter_node_gbps`` (default 25 GB/s
  per GPU, a 200-400 Gb/s NIC per GPU);
* overlap: FSDP/HSDP traffic overlaps with compute (only what exceeds the compute time counts);
  tensor-, expert-, context- and pipeline-parallel traffic is on the critical path;
* pipeline bubble (1F1B): ``(pp - 1) / (micro_batches + pp - 1)`` of the pipeline's time is idle;
* latency: ``latency_us`` (default 20 µs) per collective on the critical path (TP, EP, CP, PP).

Rank order: the layouts that fit, fastest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.config.schema import TrainConfig
from lmforge.errors import ConfigError
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.plan import BatchSchedule
from lmforge.tools.memory import estimate_memory

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_memory: int  # bytes
    nodes: int
    gpu_tflops: float = 989.0  # dense bf16 of an H100/H800 SXM
    efficiency: float = 0.5
    intra_node_gbps: float = 200.0
    inter_node_gbps: float = 25.0
    latency_us: float = 20.0  # per collective on the critical path (launch + synchronisation)

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.gpus // self.nodes)


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from the model, read once from the meta model and its config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    kv_dim: int
    num_experts: int
    moe_layers: int
    top_k: int
    vocab_size: int
    seq_length: int
    flops_per_token: float
    compute_bytes: int
    total_params: int
    expert_params: int = 0  # routed experts' parameters (sharded over ep, gathered over fsdp / ep)
    # Tied embeddings or MTP: under pp the first stage sends the embedding weight (fp32) to the last
    # stage each step and gets its gradient back (parallel/pp_tied.py).
    carried_embedding: bool = False


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    recompute: str = "none"  # "none" or "full"
    local_batch_size: int = 1

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    def dims(self, world: int) -> ParallelDims:
        return ParallelDims(
            world_size=world,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
        )

    def accumulation_steps(self, global_batch_size: int) -> int:
        """Micro-batches per rank and step: the run's own BatchSchedule for this layout."""
        return BatchSchedule(global_batch_size, self.local_batch_size, self.dp).accumulation_steps_at(0)

    def yaml(self, num_layers: int) -> str:
        lines = [
            "parallelism:",
            f"  data_parallel_shard: {self.dp_shard if self.dp_replicate > 1 else -1}",
            f"  tensor_parallel: {self.tp}",
            f"  pipeline_parallel: {self.pp}",
            f"  context_parallel: {self.cp}",
            f"  expert_parallel: {self.ep}",
            "recompute:",
        ]
        if self.recompute == "full":
            lines += ["  mode: full", f"  full_recompute_layer: ['0-{num_layers - 1}']"]
        else:
            lines.append('  mode: "None"')
        lines += ["training:", f"  local_batch_size: {self.local_batch_size}"]
        return "\n".join(lines)


@dataclass
class Plan:
    layout: Layout
    memory: int  # bytes per GPU, most loaded rank
    step_time: float  # seconds
    parts: dict[str, float] = field(default_factory=dict)  # seconds by cause
    comm: dict[str, float] = field(default_factory=dict)  # bytes per GPU per step


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def communication_volume(
    layout: Layout, model: ModelFacts, *, global_batch_size: int, world: int
) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step, by kind (``fsdp``, ``hsdp``, ``tp``, ``ep``, ``cp``, ``pp``).

    Ring collectives: all-gather / reduce-scatter of S bytes over n ranks move ``S·(n-1)/n`` per rank,
    all-reduce twice that; all-to-all moves ``(n-1)/n`` of the local data.
    """
    c = model.compute_bytes
    micro = layout.accumulation_steps(global_batch_size)
    tokens_mb = layout.local_batch_size * model.seq_length / layout.cp  # tokens per micro-batch per rank
    layers = model.num_layers / layout.pp
    # Unsharded parameters of this rank's stage and tensor shard; routed experts are further split over
    # ep and FSDP-sharded over the remaining fsdp / ep ranks.
    dense_stage = (model.total_params - model.expert_params) / (layout.tp * layout.pp)
    expert_stage = model.expert_params / (layout.tp * layout.pp * layout.ep)
    fsdp = layout.dp_shard * layout.cp
    expert_fsdp = max(1, fsdp // layout.ep)
    out: dict[str, float] = {}
    if fsdp > 1:
        out["fsdp"] = dense_stage * (2 * c + 4) * (fsdp - 1) / fsdp
        out["fsdp"] += expert_stage * (2 * c + 4) * (expert_fsdp - 1) / expert_fsdp
    if layout.dp_replicate > 1:
        r = layout.dp_replicate
        out["hsdp"] = 2 * (dense_stage / fsdp + expert_stage / expert_fsdp) * 4 * (r - 1) / r
    if layout.tp > 1:
        out["tp"] = 8 * layers * micro * tokens_mb * model.hidden_size * c * (layout.tp - 1) / layout.tp
    if layout.ep > 1 and model.moe_layers:
        moe_layers = model.moe_layers / layout.pp
        out["ep"] = (
            4
            * moe_layers
            * micro
            * tokens_mb
            * model.top_k
            * model.hidden_size
            * c
            * (layout.ep - 1)
            / layout.ep
        )
    if layout.cp > 1:
        out["cp"] = 3 * layers * micro * tokens_mb * 2 * model.kv_dim * c * (layout.cp - 1) / layout.tp
    if layout.pp > 1:
        out["pp"] = 2 * micro * tokens_mb * model.hidden_size * c
        if model.carried_embedding:
            out["pp"] += 2 * model.vocab_size * model.hidden_size * 4
    return out


def _group_gbps(size: int, stride: int, hw: Hardware) -> float:
    """Bandwidth of a group of ``size`` ranks ``stride`` apart: inside a node when it fits in one."""
    return hw.intra_node_gbps if size * stride <= hw.gpus_per_node else hw.inter_node_gbps


def step_time(
    layout: Layout, model: ModelFacts, hw: Hardware, *, global_batch_size: int
) -> tuple[float, dict]:
    world = hw.gpus
    comm = communication_volume(layout, model, global_batch_size=global_batch_size, world=world)
    tokens = global_batch_size * model.seq_length
    flops = model.flops_per_token * tokens * (4 / 3 if layout.recompute == "full" else 1.0)
    compute = flops / (world * hw.gpu_tflops * 1e12 * hw.efficiency)
    micro = layout.accumulation_steps(global_batch_size)
    bubble = compute * (layout.pp - 1) / micro if layout.pp > 1 else 0.0  # (pp-1)/(m+pp-1) of the total
    # Mesh order (outer to inner): pp, dp_replicate, dp_shard, cp, tp -> strides of each group.
    gb = 1e9
    t = {
        "tp": comm.get("tp", 0) / (_group_gbps(layout.tp, 1, hw) * gb),
        "cp": comm.get("cp", 0) / (_group_gbps(layout.cp, layout.tp, hw) * gb),
        "ep": comm.get("ep", 0) / (_group_gbps(layout.ep, layout.tp, hw) * gb),
        "pp": comm.get("pp", 0)
        / (hw.inter_node_gbps * gb if world // layout.pp >= hw.gpus_per_node else hw.intra_node_gbps * gb),
    }
    fsdp_t = comm.get("fsdp", 0) / (_group_gbps(layout.dp_shard * layout.cp, layout.tp, hw) * gb)
    hsdp_t = comm.get("hsdp", 0) / (hw.inter_node_gbps * gb)
    overlapped = max(0.0, fsdp_t + hsdp_t - compute)
    # Latency: collectives on the critical path per step (TP 8 per layer and micro-batch, EP 4 per MoE
    # layer and micro-batch, CP 2 per layer and micro-batch, PP 2 per micro-batch).
    layers = model.num_layers / layout.pp
    count = 0.0
    if layout.tp > 1:
        count += 8 * layers * micro
    if layout.ep > 1 and model.moe_layers:
        count += 4 * model.moe_layers / layout.pp * micro
    if layout.cp > 1:
        count += 2 * layers * micro
    if layout.pp > 1:
        count += 2 * micro
    parts = {
        "compute": compute,
        "bubble": bubble,
        **t,
        "latency": count * hw.latency_us * 1e-6,
        "dp (not hidden)": overlapped,
    }
    return sum(parts.values()), {"parts": parts, "comm": comm}


def model_facts(cfg: TrainConfig) -> tuple[ModelFacts, Any]:
    from lmforge.models import build_model, build_model_config

    mc = build_model_config(cfg.model)
    net = build_model(cfg.model, device="meta")
    if mc.multi_latent_attention:
        kv_dim = mc.kv_lora_rank + mc.qk_rope_head_dim
    else:
        kv_dim = mc.num_key_value_heads * mc.head_dim
    facts = ModelFacts(
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads,
        kv_dim=kv_dim,
        num_experts=mc.num_experts,
        moe_layers=len(mc.moe_layers) if mc.num_experts else 0,
        top_k=mc.num_experts_per_tok,
        vocab_size=mc.vocab_size,
        seq_length=mc.seq_length,
        flops_per_token=float(net.flops_per_token(mc.seq_length)),
        compute_bytes=_BYTES.get(mc.compute_dtype, 2),
        total_params=sum(p.numel() for p in net.parameters()),
        expert_params=sum(
            p.numel() for n, p in net.named_parameters() if ".experts." in n and "shared_expert" not in n
        ),
        carried_embedding=bool(mc.tie_word_embeddings or mc.mtp_num_layers),
    )
    return facts, (net, mc)


def candidate_layouts(model: ModelFacts, hw: Hardware, global_batch_size: int) -> list[Layout]:
    out = []
    world = hw.gpus
    for tp in [d for d in _divisors(world) if d <= min(8, hw.gpus_per_node)]:
        for pp in [d for d in _divisors(world // tp) if d <= model.num_layers]:
            for cp in [d for d in _divisors(world // (tp * pp)) if d <= 8]:
                dp = world // (tp * pp * cp)
                shards = {dp} | (
                    {max(1, hw.gpus_per_node // (tp * cp))}
                    if dp % max(1, hw.gpus_per_node // (tp * cp)) == 0
                    else set()
                )
                for dp_shard in sorted(shards):
                    if dp % dp_shard:
                        continue
                    eps = [1]
                    if model.num_experts:
                        eps = [e for e in _divisors(dp_shard * cp) if model.num_experts % e == 0]
                    for ep in eps:
                        for lbs in (1, 2, 4):
                            if global_batch_size % (dp * lbs):
                                continue
                            for rc in ("none", "full"):
                                out.append(Layout(tp, pp, cp, ep, dp_shard, dp // dp_shard, rc, lbs))
    return out


def plan(
    cfg: TrainConfig, hw: Hardware, *, global_batch_size: int | None = None
) -> tuple[list[Plan], list[Plan], ModelFacts]:
    """(layouts that fit, fastest first; the closest misses, smallest memory first; the model's facts)."""
    facts, (net, mc) = model_facts(cfg)
    gbs = int(global_batch_size or cfg.training.global_batch_size)
    fits: list[Plan] = []
    misses: list[Plan] = []
    for layout in candidate_layouts(facts, hw, gbs):
        dims = layout.dims(hw.gpus)
        try:
            dims.check_model(
                num_layers=mc.num_layers,
                num_heads=mc.num_attention_heads,
                num_kv_heads=mc.num_key_value_heads,
                num_experts=mc.num_experts or None,
                seq_length=mc.seq_length,
                vocab_size=mc.vocab_size,
            )
        except ConfigError:
            continue
        if layout.ep > 1:
            dims = ParallelDims(
                world_size=hw.gpus,
                dp_replicate=layout.dp_replicate,
                dp_shard=layout.dp_shard,
                cp=layout.cp,
                tp=layout.tp,
                pp=layout.pp,
                ep=layout.ep,
            )
        micro = layout.accumulation_steps(gbs)
        est = estimate_memory(
            net,
            dims,
            compute_dtype=mc.compute_dtype,
            optimizer_type=cfg.optimizer.type,
            seq_length=mc.seq_length,
            local_batch_size=layout.local_batch_size,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            vocab_size=mc.vocab_size,
            accumulation_steps=micro,
            moment_bytes=2 if cfg.optimizer.typed.hyper.moment_dtype == "bfloat16" else 4,
        )
        mem = est.total(recompute=layout.recompute == "full")
        seconds, detail = step_time(layout, facts, hw, global_batch_size=gbs)
        p = Plan(layout, mem, seconds, detail["parts"], detail["comm"])
        (fits if mem <= hw.gpu_memory else misses).append(p)
    fits.sort(key=lambda p: (p.step_time, p.memory))
    misses.sort(key=lambda p: p.memory)
    return fits, misses, facts


def parse_memory(text: str) -> int:
    units = {
        "": 1,
        "b": 1,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
    }
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB, 141GiB or 64GB.")
    return int(value * units[unit])
