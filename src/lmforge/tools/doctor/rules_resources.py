"""Rules of the rows "out of memory", "slow training", "MoE routing collapse / imbalance" and "differences
between ranks"."""

from __future__ import annotations

import re
from statistics import median
from typing import Any

from lmforge.tools.doctor.evidence import RunEvidence
from lmforge.tools.doctor.rule_base import (
    COLLAPSE_SHARE,
    IMBALANCE_RATIO,
    RANK_LOSS_REL,
    Finding,
    RuleResult,
    _fmt,
    _opt_type,
    _optimizer,
)


def _expert_loads(ev: RunEvidence) -> list[tuple[str, float, int]]:
    """(where, largest share of a layer's routed tokens one expert got, experts) over the run's second
    half: from the monitor files (``monitor.moe_monitor``), else from the live doctor's metric."""
    out = []
    for layer, rows in sorted(ev.tokens_per_expert.items()):
        recent = rows[len(rows) // 2 :]
        totals = [sum(col) for col in zip(*recent)]
        s = sum(totals)
        if s:
            out.append((f"layer {layer}", max(totals) / s, len(totals)))
    experts = ev.facts.get("moe_num_experts")
    if not out and experts:
        recs = [r for r in ev.metrics if isinstance(r.get("moe_max_expert_share"), (int, float))]
        recent = recs[len(recs) // 2 :]
        if recent:
            share = sum(r["moe_max_expert_share"] for r in recent) / len(recent)
            layers = sorted({int(r.get("moe_max_expert_share_layer", -1)) for r in recent})
            out.append((f"layer(s) {layers}", share, int(experts)))
    return out


def _moe_keys(ev: RunEvidence) -> dict[str, Any]:
    model = ev.section("model")
    coeff = model.get("moe_aux_loss_coeff", model.get("router_aux_loss_coef"))
    keys: dict[str, Any] = {}
    if model.get("moe_router_load_balancing_type") == "none" or not coeff:
        keys["model.moe_router_load_balancing_type"] = "aux_loss"
        keys["model.moe_aux_loss_coeff"] = 1e-3
    else:
        keys["model.moe_aux_loss_coeff"] = float(coeff) * 10
    if not model.get("moe_router_enable_expert_bias"):
        keys["model.moe_router_enable_expert_bias"] = True
    return keys


def moe_routing(ev: RunEvidence) -> RuleResult:
    loads = _expert_loads(ev)
    if not loads:
        return None
    top_k = ev.section("model").get("num_experts_per_tok") or ev.facts.get("moe_top_k") or 1
    # With top-k routing a token's k picks are distinct experts: one expert holds at most 1/k of them.
    collapse_at = COLLAPSE_SHARE / top_k
    where, share, n = max(loads, key=lambda x: x[1] * x[2])
    if n > top_k and share >= collapse_at:
        return Finding(
            symptom="MoE routing collapse",
            evidence=f"{where}: one expert takes {100 * share:.0f}% of the routed tokens over the last half of the "
            f"run ({n} experts, top-{top_k}: a balanced expert takes {100 / n:.0f}%)",
            cause="the router sends (almost) every token to the same expert(s); the others never train",
            keys=_moe_keys(ev),
        )
    ratio = share * n
    if ratio >= IMBALANCE_RATIO:
        return Finding(
            symptom="MoE load imbalance",
            evidence=f"{where}: the busiest expert gets {ratio:.1f}x the mean load over the last half of the run",
            cause="routing imbalance: the load balancing is too weak for this model",
            keys=_moe_keys(ev),
        )
    return f"expert loads within {IMBALANCE_RATIO:g}x of the mean (busiest {ratio:.1f}x)"


def _memory_options(ev: RunEvidence) -> list[tuple[dict[str, Any], int, int]] | None:
    """(keys, estimated bytes per GPU, number of remedies) for the run as configured and for each single remedy, from the
    same estimate as ``lmforge check`` / ``lmforge plan``; None when the config cannot be built."""
    try:
        from lmforge.config import load_config
        from lmforge.models import build_model, build_model_config
        from lmforge.parallel import BatchSchedule, ParallelDims
        from lmforge.tools.memory import estimate_memory

        cfg = load_config(ev.config)
        mc = build_model_config(cfg.model)
        net = build_model(cfg.model, device="meta")
        world = int(ev.facts.get("world_size") or (ev.checkpoint or {}).get("world_size") or 1)
        dims = ParallelDims.from_section(cfg.parallelism, world)
    except Exception:  # a config from another version, a model lmforge cannot build: no estimate
        return None
    training = ev.section("training")
    lbs = int(training.get("local_batch_size", 1))
    gbs = int(training.get("global_batch_size", lbs))
    opt_type = _opt_type(ev)
    recompute_on = str(ev.section("recompute").get("mode", "None")) == "full"

    moments = 2 if _optimizer(ev).get("moment_dtype") == "bfloat16" else 4

    def estimate(
        lbs_: int = lbs, recompute: bool = recompute_on, offload: bool = False, moment_bytes: int = moments
    ) -> int:
        est = estimate_memory(
            net,
            dims,
            compute_dtype=mc.compute_dtype,
            optimizer_type=opt_type,
            seq_length=mc.seq_length,
            local_batch_size=lbs_,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            vocab_size=mc.vocab_size,
            accumulation_steps=BatchSchedule(gbs, max(1, lbs_), dims.dp).accumulation_steps_at(0),
            moment_bytes=moment_bytes,
            offload_states=offload,
        )
        return est.total(recompute=recompute)

    remedies: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (YAML keys, estimate() arguments)
    if not recompute_on:
        full = {"recompute.mode": "full", "recompute.full_recompute_layer": [f"0-{mc.num_layers - 1}"]}
        remedies.append((full, {"recompute": True}))
    if opt_type.lower() in ("adamw", "lamb", "lion") and not _optimizer(ev).get("offload_states"):
        remedies.append(({"optimizer.offload_states": True}, {"offload": True}))
    if moments == 4 and opt_type.lower() in ("adamw", "muon"):
        remedies.append(({"optimizer.moment_dtype": "bfloat16"}, {"moment_bytes": 2}))  # state compression
    if lbs > 1:
        remedies.append(({"training.local_batch_size": lbs // 2}, {"lbs_": lbs // 2}))
    singles = sorted(((k, a, estimate(**a)) for k, a in remedies), key=lambda r: r[2])
    options: list[tuple[dict[str, Any], int, int]] = [({}, estimate(), 0)]  # (keys, bytes, remedies)
    options += [(k, b, 1) for k, _, b in singles]
    # Remedies applied one after the other, largest saving first.
    keys: dict[str, Any] = {}
    args: dict[str, Any] = {}
    for i, (k, a, _) in enumerate(singles):
        keys, args = {**keys, **k}, {**args, **a}
        if i > 0:
            options.append((dict(keys), estimate(**args), i + 1))
    return options


def out_of_memory(ev: RunEvidence) -> RuleResult:
    if not ev.log_lines:
        return None
    hit = next(
        (
            ln
            for ln in ev.log_lines
            if re.search(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC", ln, re.I)
        ),
        None,
    )
    if hit is None:
        return "train.log reports no out-of-memory error"
    from lmforge.tools.memory import format_bytes

    options = _memory_options(ev) if ev.config else None
    capacity = ev.facts.get("device_memory_bytes")
    keys: dict[str, Any] = {}
    evidence = f"train.log: {hit.strip()[:200]}"
    if options:
        current = options[0][1]
        remedies = options[1:]
        evidence += f"; estimated peak per GPU as configured {format_bytes(current)}"
        evidence += "; with " + "; with ".join(f"{', '.join(k)}: {format_bytes(b)}" for k, b, _ in remedies)
        fitting = [o for o in remedies if capacity and o[1] <= 0.9 * capacity]
        # The smallest change that fits the device (10% headroom), else the largest saving.
        chosen = min(fitting, key=lambda o: (o[2], o[1])) if fitting else min(remedies, key=lambda o: o[1])
        keys.update(chosen[0])
        if capacity:
            evidence += f" (device: {format_bytes(capacity)})"
    else:
        if str(ev.section("recompute").get("mode", "None")) in ("None", "none", ""):
            keys["recompute.mode"] = "full"
        lbs = ev.section("training").get("local_batch_size")
        if isinstance(lbs, int) and lbs > 1:
            keys["training.local_batch_size"] = lbs // 2
    return Finding(
        symptom="out of memory",
        evidence=evidence,
        cause="the step does not fit: activations, optimizer states or both; `lmforge plan` lists the layouts "
        "that fit a number of GPUs",
        keys=keys,
    )


def rank_differences(ev: RunEvidence) -> RuleResult:
    if len(ev.rank_losses) < 2:
        return None
    means = {r: sum(v[len(v) // 2 :]) / len(v[len(v) // 2 :]) for r, v in ev.rank_losses.items()}
    mid = median(means.values())
    off = {r: m for r, m in means.items() if mid and abs(m - mid) / abs(mid) > RANK_LOSS_REL}
    if not off:
        return f"the {len(means)} ranks' local losses agree (within {100 * RANK_LOSS_REL:.0f}% of the median)"
    return Finding(
        symptom="results differ between ranks",
        evidence="; ".join(
            f"rank {r}: mean local loss {_fmt(m)} vs median {_fmt(mid)}" for r, m in sorted(off.items())
        ),
        cause="ranks do not train the same model: parameter groups, config or code differ between ranks "
        "(run every rank with the same train.yaml and lmforge version)",
        keys={},
    )


def emulated_compute_dtype(ev: RunEvidence) -> RuleResult:
    """A 16-bit compute dtype that the run's device only emulates (the live doctor measured it there:
    doctor_facts.json ``compute_dtype_emulated``): every matmul ran many times slower than in float32."""
    note = ev.facts.get("compute_dtype_emulated")
    dtype = ev.facts.get("compute_dtype")
    if not isinstance(note, str) or not note:
        return f"model.compute_dtype {dtype} is native on the run's device" if dtype else None
    times = [r["step_time"] for r in ev.metrics if isinstance(r.get("step_time"), (int, float))]
    seen = f"; median step time {_fmt(median(times))} s" if times else ""
    return Finding(
        symptom="slow training (16-bit compute emulated)",
        evidence=f"{note}{seen}",
        cause=f"model.compute_dtype {dtype} on a device without native {dtype} matmuls: they are emulated",
        keys={"model.compute_dtype": "auto"},
    )
