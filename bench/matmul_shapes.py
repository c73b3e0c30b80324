"""The per-FLOP gap, shape by shape: every matmul and SDPA call of one lmforge step and one Hugging Face
step, each timed alone (issue 35).

    PYTHONPATH=src .venv/bin/python bench/matmul_shapes.py [--model 100m] [--repeats 7] [--no-write]

Both loops are built exactly as ``bench/train.py`` builds them (same weights, batch, dtype). One eager
step of each runs under a ``TorchDispatchMode`` that records every aten matmul-family call (``mm``,
``addmm``, ``bmm``, ``baddbmm``) and every SDPA forward/backward, with its shapes, strides and dtype:
the census is exact and does not depend on the machine's load. Then each distinct call is replayed on
fresh tensors of the same shapes *and strides* (a transposed operand stays transposed), the two loops'
calls alternating, and timed as the fastest of ``--repeats`` runs (the minimum filters out other
processes' interference). Calls x time per call gives each loop's matmul and SDPA time per step, and
the table says where the difference lies: in the FLOPs, in the number of calls, or in the time per
FLOP of a shape or layout.

Writes the "## Matmuls shape by shape" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train as bench  # bench/train.py
from benchdoc import replace_section
from lmforge.utils import malloc

aten = torch.ops.aten
# The .out overloads too: compiled code (lmforge's chunked loss) calls its matmuls with out= buffers.
MATMULS = {
    getattr(getattr(aten, op), overload)
    for op in ("mm", "addmm", "bmm", "baddbmm")
    for overload in ("default", "out")
}
SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "sdpa fwd (flash, cpu)",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "sdpa bwd (flash, cpu)",
    aten._scaled_dot_product_efficient_attention.default: "sdpa fwd (efficient)",
    aten._scaled_dot_product_efficient_attention_backward.default: "sdpa bwd (efficient)",
    aten._scaled_dot_product_attention_math.default: "sdpa (math)",
}


@dataclass(frozen=True)
class Call:
    """One distinct call: the op, its tensor arguments' (shape, stride, dtype) in order, and its argument
    list with each tensor replaced by its index into ``tensors``."""

    op: str
    tensors: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]
    args: tuple
    kwargs: tuple

    @property
    def is_sdpa(self) -> bool:
        return "scaled_dot_product" in self.op

    @property
    def flops(self) -> float:
        shapes = [t[0] for t in self.tensors]
        if not self.is_sdpa:
            a, b = (shape for shape, _, _ in self.operands())
            return 2.0 * _prod(a) * b[-1]
        backward = "backward" in self.op
        q, k = (shapes[1], shapes[2]) if backward else (shapes[0], shapes[1])  # [b, h, s, d]
        causal = any(v is True for v in self.args) or dict(self.kwargs).get("is_causal", False)
        fwd = 4.0 * q[0] * q[1] * q[2] * k[2] * q[3] * (0.5 if causal else 1.0)
        return fwd * (2.5 if backward else 1.0)

    def layout(self) -> str:
        """N or T per operand of a product: read row-major, or transposed (column-major)."""
        if self.is_sdpa:
            return ""
        return "".join("T" if stride[-1] != 1 else "N" for _, stride, _ in self.operands())

    def operands(self) -> list:
        """The two factors of a product: the last two positional tensors (addmm/baddbmm: (bias, a, b);
        an ``out=`` buffer is a keyword argument)."""
        positional = [a.index for a in self.args if isinstance(a, _T)]
        return [self.tensors[i] for i in positional[-2:]]

    def describe(self) -> str:
        if self.is_sdpa:
            return " ".join("x".join(map(str, sh)) for sh, _, _ in self.tensors[:3])
        return " @ ".join("x".join(map(str, sh)) for sh, _, _ in self.operands())


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _T:
    """Placeholder of a tensor argument in a recorded call."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _T) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("T", self.index))


def _op_of(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


class Census(TorchDispatchMode):
    """Counts every matmul-family and SDPA call that reaches aten."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[Call] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS or func in SDPA:
            tensors: list = []

            def mark(a):
                if isinstance(a, torch.Tensor):
                    tensors.append((tuple(a.shape), tuple(a.stride()), str(a.dtype).replace("torch.", "")))
                    return _T(len(tensors) - 1)
                return tuple(a) if isinstance(a, list) else a

            marked = tuple(mark(a) for a in args)
            marked_kw = tuple(sorted((k, mark(v)) for k, v in kwargs.items()))
            self.calls[Call(str(func), tuple(tensors), marked, marked_kw)] += 1
        return func(*args, **kwargs)


def replay(call: Call, tensors_of: dict):
    """A closure that runs ``call`` on tensors of the same shapes and strides (random values)."""
    if call not in tensors_of:
        made = []
        for shape, stride, dtype in call.tensors:
            dt = getattr(torch, dtype)
            # as_strided over a base big enough for the recorded strides keeps the memory layout.
            span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
            base = torch.randn(span).to(dt) if dt.is_floating_point else torch.zeros(span, dtype=dt)
            made.append(base.as_strided(shape, stride))
        tensors_of[call] = made
    made = tensors_of[call]

    def real(a):
        return made[a.index] if isinstance(a, _T) else a

    args = [real(a) for a in call.args]
    kwargs = {k: real(v) for k, v in call.kwargs}
    func = _op_of(call.op)
    return lambda: func(*args, **kwargs)


def timed_min(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def census_of(step) -> collections.Counter:
    mode = Census()
    with mode:
        step()
    return mode.calls


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="100m", choices=sorted(bench.MODELS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    malloc.apply_malloc_defaults()
    section = bench.MODELS[args.model]
    b, s = section["batch"], section["seq_length"]
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, section["vocab_size"], (b, s + 1), generator=g)
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].clone(), "full": full[:, :-1]}
    with tempfile.TemporaryDirectory() as tmp:
        lf_model, _, lf_step = bench.lmforge_runner(section, {k: v for k, v in batch.items() if k != "full"})
        hf_model, hf_step = bench.hf_runner(lf_model, batch, Path(tmp))
        lf_step(), hf_step()  # warm-up outside the census
        loops = {"lmforge": census_of(lf_step), "HF": census_of(hf_step)}
    # Time every distinct call, the two loops' calls interleaved so that background load hits both.
    tensors_of: dict = {}
    per_call: dict[Call, float] = {}
    order = [c for pair in zip(*(sorted(v, key=str) for v in loops.values())) for c in pair]
    order += [c for v in loops.values() for c in v if c not in order]
    for i, call in enumerate(order):
        if call not in per_call:
            per_call[call] = timed_min(replay(call, tensors_of), args.repeats)
        print(f"\r timed {i + 1}/{len(order)} distinct calls", end="", flush=True)
    print()
    rows = summarize(loops, per_call)
    text = report(args.model, loops, per_call, rows)
    print(text)
    if not args.no_write:
        doc = bench.DOC
        doc.write_text(replace_section(doc.read_text(), "## Matmuls shape by shape", text))
        print(f"updated {doc}")
    return 0


def kind_of(call: Call) -> str:
    return SDPA[_op_of(call.op)] if call.is_sdpa else "matmul"


def summarize(loops: dict, per_call: dict) -> list[tuple]:
    rows = []
    for loop, calls in loops.items():
        for call, n in calls.items():
            t = per_call[call]
            rows.append((loop, kind_of(call), call, n, t, call.flops))
    return rows


def report(model: str, loops: dict, per_call: dict, rows: list[tuple]) -> str:
    load = os.getloadavg()[0]
    out = [
        "## Matmuls shape by shape",
        "",
        f"`bench/matmul_shapes.py --model {model}`: every matmul-family and SDPA call of one eager training "
        "step of each loop (recorded at aten level, so the counts are exact), each distinct call timed alone "
        "on tensors of the same shapes and strides, the fastest of several runs, the loops' calls "
        f"interleaved. Machine: {bench.machine()}; load average {load:.1f} at the end.",
        "",
        "| loop | kind | calls / step | GFLOP / step | time / step (ms) | GFLOP/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    totals = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for loop, kind, _call, n, t, flops in rows:
        k = totals[(loop, kind)]
        k[0] += n
        k[1] += n * flops
        k[2] += n * t
    for (loop, kind), (n, fl, t) in sorted(totals.items()):
        out.append(f"| {loop} | {kind} | {n} | {fl / 1e9:.1f} | {1e3 * t:.1f} | {fl / t / 1e9:.0f} |")
    # Per FLOP, each kind of call on its own: lmforge's speed against the HF loop's (1.00 = the same).
    ratios = []
    for kind in sorted({k for _, k in totals}):
        if ("lmforge", kind) in totals and ("HF", kind) in totals:
            (_, lf_fl, lf_t), (_, hf_fl, hf_t) = totals[("lmforge", kind)], totals[("HF", kind)]
            ratios.append(f"{kind} {(lf_fl / lf_t) / (hf_fl / hf_t):.3f}")
    out += ["", "Per FLOP, calls timed alone, lmforge / HF (1.000 = as fast): " + "; ".join(ratios) + "."]
    out += [
        "",
        "Matmuls grouped by the output shape's role: per loop, each distinct (shape, layout) with its calls, "
        "time per call and GFLOP/s. Layout: N = operand read row-major, T = read transposed.",
        "",
        "| loop | op | operands (shape, layout) | dtype | calls | ms / call | GFLOP/s |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for loop, _kind, call, n, t, flops in sorted(rows, key=lambda r: (r[1], -r[3] * r[4], r[0])):
        shapes = call.describe()
        dtype = call.tensors[0][2] if call.is_sdpa else call.operands()[-1][2]
        op = call.op.replace("aten.", "").replace(".default", "")
        out.append(
            f"| {loop} | {op} | {shapes} ({call.layout() or '-'}) | {dtype} | {n} | {1e3 * t:.3f} | {flops / t / 1e9:.0f} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
