"""One lmforge step and one Hugging Face step side by side under ``torch.profiler`` (issue 15).

    PYTHONPATH=src .venv/bin/python bench/profile_step.py [--model demo|100m] [--steps 2] [--top 40]

Builds both loops exactly as ``bench/train.py --only throughput`` does (same weights and batch), runs
warm-up steps, then profiles ``--steps`` steps of each and prints, per loop, the ops grouped by name
(CPU total and self time in ms per step, calls per step), and the time per op family: forward ops are
attributed to the module family they run in (record_function scopes opened by forward hooks), backward
ops to the autograd node that runs them, the rest to the step phase (optimizer, clipping, bookkeeping).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import train as bench  # bench/train.py

# Module class name -> family (ours and transformers').
FAMILIES = {
    "RMSNorm": "norms",
    "Qwen3RMSNorm": "norms",
    "RotaryEmbedding": "rope",
    "Qwen3RotaryEmbedding": "rope",
    "CoreAttention": "attention core",
    "SwiGLUMLP": "mlp",
    "Qwen3MLP": "mlp",
    "Embedding": "embedding",
}


def scope_hooks(model: torch.nn.Module) -> None:
    """Open a record_function scope named after the module's family around its forward."""
    for m in model.modules():
        fam = FAMILIES.get(type(m).__name__)
        if fam is None:
            continue

        def pre(mod, args, fam=fam):
            mod._prof_scope = record_function(f"fam::{fam}")
            mod._prof_scope.__enter__()

        def post(mod, args, out):
            mod._prof_scope.__exit__(None, None, None)

        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)


def family_of_backward(node: str) -> str:
    n = node.lower()
    if "rmsnorm" in n or "rsqrt" in n or "pow" in n or "mean" in n:
        return "bwd: norms (rms_norm / pow-mean-rsqrt)"
    if "attention" in n:
        return "bwd: attention core"
    if "silu" in n:
        return "bwd: silu"
    if "mm" in n or "linear" in n:
        return "bwd: matmuls"
    if "embedding" in n:
        return "bwd: embedding"
    if "logsoftmax" in n or "nll" in n or "crossentropy" in n:
        return "bwd: loss"
    if "tobackward" in n or "copy" in n:
        return "bwd: dtype casts"
    return "bwd: elementwise/view (" + node.split("::")[-1].strip() + ")"


def summarize(prof, steps: int, top: int, title: str) -> None:
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\n=== {title}: ops by self CPU time (ms per step) ===")
    print(f"{'op':60s} {'self':>8s} {'total':>8s} {'calls':>6s}")
    for e in rows[:top]:
        if e.key.startswith(("fam::", "phase::", "ProfilerStep")):
            continue
        print(
            f"{e.key[:60]:60s} {e.self_cpu_time_total / 1e3 / steps:8.2f} {e.cpu_time_total / 1e3 / steps:8.2f} "
            f"{e.count // steps:6d}"
        )
    fam = collections.Counter()
    bwd = collections.Counter()
    for e in events:
        if e.key.startswith(("fam::", "phase::")):
            fam[e.key] += e.cpu_time_total / 1e3 / steps
        elif e.key.startswith("autograd::engine::evaluate_function:"):
            node = e.key.split(":", 4)[-1].strip()
            bwd[family_of_backward(node)] += e.cpu_time_total / 1e3 / steps
    print(f"--- {title}: forward families and phases (CPU total ms per step, nested scopes overlap) ---")
    for k, v in sorted(fam.items(), key=lambda kv: -kv[1]):
        print(f"{k:60s} {v:8.2f}")
    print(f"--- {title}: backward by autograd node family (CPU total ms per step) ---")
    for k, v in sorted(bwd.items(), key=lambda kv: -kv[1]):
        print(f"{k:60s} {v:8.2f}")
    casts = [e for e in events if e.key in ("aten::to", "aten::_to_copy", "aten::copy_")]
    print(f"--- {title}: casts and copies by input shape (self ms per step, calls) ---")
    for e in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total):
        if (
            e.key in ("aten::_to_copy", "aten::copy_", "aten::cat")
            and e.self_cpu_time_total / 1e3 / steps > 0.05
        ):
            print(
                f"{e.key:16s} {str(e.input_shapes)[:90]:90s} {e.self_cpu_time_total / 1e3 / steps:7.2f} {e.count // steps:4d}"
            )
    del casts


def wrap_phases(step_obj, opt) -> None:
    """Scopes around the optimizer step and the gradient norm (lmforge's TrainStep)."""
    import lmforge.train.step as step_mod

    orig_norm = step_mod.grad_norms

    def norm(*a, **k):
        with record_function("phase::grad norm"):
            return orig_norm(*a, **k)

    step_mod.grad_norms = norm
    orig_step = opt.step

    def ostep(*a, **k):
        with record_function("phase::optimizer"):
            return orig_step(*a, **k)

    opt.step = ostep


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--only", choices=["lmforge", "hf"], default=None)
    args = p.parse_args()
    from lmforge.utils import malloc

    malloc.apply_malloc_defaults()  # as bench/train.py and the lmforge command
    section = bench.MODELS[args.model]
    b, s = section["batch"], section["seq_length"]
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, section["vocab_size"], (b, s + 1), generator=g)
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].clone(), "full": full[:, :-1]}
    lf_model, lf_opt, lf_step = bench.lmforge_runner(section, {k: v for k, v in batch.items() if k != "full"})
    with tempfile.TemporaryDirectory() as tmp:
        hf_model, hf_step = bench.hf_runner(lf_model, batch, Path(tmp))
    scope_hooks(lf_model)
    scope_hooks(hf_model)
    wrap_phases(lf_step, lf_opt)
    for name, fn in (("lmforge", lf_step), ("hf", hf_step)):
        if args.only and name != args.only:
            continue
        fn(), fn()  # warm-up
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                with record_function("phase::step"):
                    fn()
        summarize(prof, args.steps, args.top, f"{name} {args.model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
