"""Memory of document masking under context parallel: dense ``[B,1,S,S]`` mask vs document spans.

    .venv/bin/python bench/cp_document_mask.py [--seq 4096 16384] [--no-write]
    .venv/bin/python bench/cp_document_mask.py --variant NAME --seq S   (one measurement; one JSON line)

One process simulates rank 0 of cp = 2 on one micro-batch with a few packed documents
(``actual_seq_len``), forward and backward of one attention call, fp32:

* all-gather-KV (``colossal``): the rank's two query chunks (load-balanced order) against the whole
  sequence's K/V as gathered (``parallel.cp._attend_chunks``);
* Ulysses: the whole sequence for ``H/cp`` heads (what the rank holds after the all-to-all).

``dense`` is the path before this change (``build_allowed_mask`` for the whole sequence, indexed by
global positions, SDPA with ``attn_mask``: still the path of an explicit ``attention_mask``);
``spans`` is the path now (``attention_layout`` → ``DocumentSegments``, per-(chunk, document) SDPA).
Memory is the Linux peak resident set (VmHWM) above the RSS before the mask is built, in a fresh
process per variant, minus the output and the input gradients (the same in both). The two outputs
are also compared (max relative difference). Writes the "## Document masks under CP" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
CP, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 32
VARIANTS = ("gathered_dense", "gathered_spans", "ulysses_dense", "ulysses_spans")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


def _ends(seq: int) -> torch.Tensor:
    """Four documents whose boundaries fall inside chunks (not on them)."""
    return torch.tensor([[int(seq * f) for f in (0.18, 0.43, 0.74)] + [seq]])


def measure(variant: str, seq: int) -> dict:
    from lmforge.models.common.attention import CoreAttention, segment_attention
    from lmforge.models.common.masks import attention_layout, build_allowed_mask
    from lmforge.parallel.cp import _attend_chunks

    method, path = variant.split("_")
    g = torch.Generator().manual_seed(0)
    ends = _ends(seq)
    core = CoreAttention(HEADS, HEAD_DIM**-0.5)
    if method == "gathered":
        c = seq // (2 * CP)
        chunks = [0, 2 * CP - 1]
        q = torch.randn(1, HEADS, 2 * c, HEAD_DIM, generator=g, requires_grad=True)
        kv_heads = KV_HEADS
    else:
        q = torch.randn(1, HEADS // CP, seq, HEAD_DIM, generator=g, requires_grad=True)
        kv_heads = KV_HEADS // CP
    k, v = (torch.randn(1, kv_heads, seq, HEAD_DIM, generator=g, requires_grad=True) for _ in range(2))
    base = _reset_peak()
    t0 = time.perf_counter()
    if path == "dense":  # what shard_batch kept before: the whole-sequence may-attend mask
        layout = build_allowed_mask(seq, q.device, None, ends)
    else:
        layout = attention_layout(seq, q.device, None, ends)
    if method == "gathered":
        out = _attend_chunks(core, q, k, v, chunks, CP, layout, 0)
    elif path == "dense":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout, scale=core.scale, enable_gqa=True)
    else:
        out = segment_attention(q, k, v, layout, core.scale)
    out.backward(torch.ones_like(out))
    seconds = time.perf_counter() - t0
    kept = sum(t.numel() * t.element_size() for t in (out, q.grad, k.grad, v.grad))
    extra = _status("VmHWM:") - base - kept
    return {
        "variant": variant,
        "extra_bytes": extra,
        "seconds": seconds,
        "out": out.detach().flatten()[::97].tolist(),
    }


def _run(variant: str, seq: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, __file__, "--variant", variant, "--seq", str(seq)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def section(seqs: list[int], results: dict[tuple[int, str], dict], load: float) -> str:
    fractions = [round(e / seqs[-1], 2) for e in _ends(seqs[-1])[0].tolist()]
    lines = [
        "## Document masks under CP",
        "",
        f"`bench/cp_document_mask.py --seq {' '.join(map(str, seqs))}` (commit {_commit()}). Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads. Load average at "
        f"start: {load:.1f}. One process simulates rank 0 of cp = 2: one attention call, forward and "
        f"backward, fp32, batch 1, {HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, four documents ending at "
        f"{fractions} × S (`actual_seq_len`). Peak RSS (VmHWM) above the RSS before the mask is built, minus the "
        "output and input gradients, one fresh process per row. `dense` is the path before (the whole "
        "sequence's `[B,1,S,S]` mask from `build_allowed_mask`, indexed by global positions); `spans` the "
        "path now (`DocumentSegments`, one SDPA call per (query chunk, document)).",
        "",
        "| S | CP method | mask path | peak beyond inputs | vs dense | time | outputs equal |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for seq in seqs:
        for method, label in (("gathered", "all-gather KV"), ("ulysses", "Ulysses")):
            dense, spans = results[seq, f"{method}_dense"], results[seq, f"{method}_spans"]
            ref = torch.tensor(dense["out"])
            diff = ((torch.tensor(spans["out"]) - ref).abs().max() / ref.abs().max()).item()
            for name, r in (("dense", dense), ("spans", spans)):
                ratio = r["extra_bytes"] / dense["extra_bytes"]
                same = "" if name == "dense" else f"max rel. diff {diff:.1e}"
                lines.append(
                    f"| {seq} | {label} | {name} | {_gib(r['extra_bytes'])} | {ratio:.3f}x | "
                    f"{r['seconds']:.1f} s | {same} |"
                )
    seq = seqs[-1]
    lines += [
        "",
        f"At S = {seq} the dense mask alone is S² = {seq**2 / 2**20:.0f} MiB of booleans per row (plus its indexed copy "
        "and SDPA's float version of it); the spans are a few integers, and the strided bias of a "
        "bottom-right causal piece is one vector of Lq + Lk entries. Times include the attention work, "
        "which the span path also reduces (no products across documents).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.seq[0])))
        return 0
    load = os.getloadavg()[0]
    results = {(s, v): _run(v, s) for s in args.seq for v in VARIANTS}
    text = section(args.seq, results, load)
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(Path(__file__).parent))
        from benchdoc import write_section

        write_section("## Document masks under CP", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
