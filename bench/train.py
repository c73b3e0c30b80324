"""Training throughput and checkpoint save/load: lmforge against plain PyTorch / transformers peers.

    .venv/bin/python bench/train.py [--models demo,100m] [--steps N] [--rounds R] [--no-write]

Throughput: for each model, the same Qwen3 architecture, weights, batch, sequence length and AdamW
hyper-parameters run in

* lmforge: the trainer's build path (``build_training_model``: meta build, FSDP2 over this one process
  with fp32 parameters, bf16 compute and fp32 gradient reduction) + ``build_optimizer`` AdamW on the
  fp32 parameters + the trainer's own ``TrainStep`` (token-mean loss, global-norm clipping);
* a plain Hugging Face loop: ``transformers`` ``Qwen3ForCausalLM`` loaded from the same weights
  (``save_hf_pretrained``), fp32 parameters under ``torch.autocast(bfloat16)`` (the usual bf16
  mixed-precision recipe, fp32 master weights like ours), ``torch.optim.AdamW``,
  ``clip_grad_norm_(1.0)``, ``loss.backward()``.

Both loops run in one process under lmforge's allocator defaults (``utils/malloc.py``: freed memory kept
in the process, as ``lmforge train`` runs); ``LMFORGE_MALLOC=default`` measures both under glibc's own.
Rounds alternate between the two (background load hits both alike); tokens/s is the median over the
timed steps of all rounds. MFU = FLOPs/token (the model's ``flops_per_token``, forward + backward)
x tokens/s / the bf16 matmul peak measured in this run.

Checkpoints: the lmforge 100M-model training state (fp32 weights, AdamW moments, RNG, ...)
saved with ``CheckpointManager`` (sync: until published; async: time the step is blocked), loaded
with ``load_checkpoint``, against ``torch.save`` / ``torch.load`` of the same tensors to the same disk.

Compiled (``--compile``): lmforge with ``compile: {enable: true}`` (each block compiled) against the
HF loop with ``torch.compile`` applied to the whole model, as extra rows; compile time is excluded
(two warm-up steps), and both compile in the same process.

Memory (``--only memory``): ``bench/step_memory.py`` in a fresh process per variant, at seq 2048 and
a 151,936-token vocabulary (Qwen3-0.6B-shaped, cut to 2 layers): the loss alone (plain vs chunked) and
a whole step's peak beyond parameters, gradients and optimizer states (lmforge plain / chunked vs the
HF loop).

Writes the "## Training throughput", "## Checkpoint save/load" and "## Loss and step memory" sections
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchdoc import replace_section
from lmforge.config import validate_section
from lmforge.models import save_hf_pretrained
from lmforge.optim import build_optimizer
from lmforge.train.builder import build_training_model
from lmforge.train.checkpoint import Checkpointable, CheckpointManager, load_checkpoint, resolve_checkpoint
from lmforge.train.perf import matmul_peak_flops
from lmforge.train.step import TrainStep
from lmforge.utils import malloc

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"

QWEN3 = {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM", "compute_dtype": "bfloat16"}
MODELS = {
    # configs/demo.yaml's model.
    "demo": {
        **QWEN3,
        "vocab_size": 8192,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "seq_length": 256,
        "tie_word_embeddings": True,
        "batch": 8,
    },
    # ~100M parameters (Qwen3 layout: 12 layers of 768, 12 heads / 4 KV heads, SwiGLU 2048, vocab 32000, tied).
    "100m": {
        **QWEN3,
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "seq_length": 256,
        "tie_word_embeddings": True,
        "batch": 4,
    },
}
ADAMW = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.01}
LR = 1.0e-4


def lmforge_model(section: dict, compiled: bool = False):
    """The trainer's build path: meta build, FSDP2 over this one process (fp32 parameters, compute in
    bf16, fp32 gradient reduction), init with seed 0; compiled blocks before FSDP2, as in the trainer."""
    hook = None
    if compiled:
        from lmforge.config.sections_speed import CompileConfig
        from lmforge.parallel.compile import compile_blocks

        def hook(model):
            compile_blocks(model, CompileConfig(enable=True))

    model_section = {k: v for k, v in section.items() if k != "batch"}
    return build_training_model(
        validate_section("model", model_section), seed=0, device="cpu", before_fsdp=hook
    )


def lmforge_runner(section: dict, batch: dict, compiled: bool = False):
    model, ctx = lmforge_model(section, compiled)
    opt = build_optimizer(validate_section("optimizer", ADAMW), model, LR)
    step = TrainStep(model, opt, None, max_norm=1.0, ctx=ctx)
    return model, opt, (lambda: step([batch]))


def hf_runner(lmforge_model, batch: dict, workdir: Path, compiled: bool = False):
    import transformers

    path = workdir / "hf"
    save_hf_pretrained(lmforge_model, path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    if compiled:
        model.compile()
    return model, hf_step(model, batch["full"])


def hf_step(model, ids: torch.Tensor, compute_dtype: torch.dtype = torch.bfloat16):
    """One training step of the plain HF loop on ``ids`` (transformers shifts the labels itself): autocast to
    ``compute_dtype`` over fp32 parameters (none for float32), clipping at 1.0, and the peer's optimizer in
    its fastest form, torch's fused AdamW (its default foreach path is several times slower here)."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True
    )

    def step():
        with torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def timed(fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_throughput(name: str, steps: int, rounds: int, workdir: Path, compiled: bool = False) -> dict:
    section = MODELS[name]
    b, s = section["batch"], section["seq_length"]
    if compiled:  # compiled code is cached per function: another model's graphs would recompile as dynamic
        torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, section["vocab_size"], (b, s + 1), generator=g)
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].clone(), "full": full[:, :-1]}
    lf_model, _, lf_step = lmforge_runner(section, {k: v for k, v in batch.items() if k != "full"}, compiled)
    hf_model, hf_step = hf_runner(lf_model, batch, workdir, compiled)
    params = sum(p.numel() for p in lf_model.parameters())
    flops_per_token = lf_model.flops_per_token(s)
    lf_times, hf_times = [], []
    # Warm-up (allocations, kernels), and a check that both loops train the same model on the same batch.
    lf_loss, hf_loss = lf_step().loss, float(hf_step())
    if abs(lf_loss - hf_loss) > 0.02 * abs(hf_loss):
        raise RuntimeError(
            f"{name}: first-step losses differ: lmforge {lf_loss:.5f}, transformers {hf_loss:.5f}"
        )
    if compiled:  # a second warm-up step: the backward graphs and any recompile land here, not in the timing
        lf_step(), hf_step()
    for _ in range(rounds):
        lf_times += timed(lf_step, steps)
        hf_times += timed(hf_step, steps)
    peak = matmul_peak_flops(torch.device("cpu"), torch.bfloat16)
    tokens = b * s
    lf_tps, hf_tps = tokens / statistics.median(lf_times), tokens / statistics.median(hf_times)
    del hf_model
    return {
        "name": name + (" (compiled)" if compiled else ""),
        "params": params,
        "batch": b,
        "seq": s,
        "lf_tps": lf_tps,
        "hf_tps": hf_tps,
        "lf_mfu": flops_per_token * lf_tps / peak,
        "hf_mfu": flops_per_token * hf_tps / peak,
        "peak": peak,
        "samples": len(lf_times),
        "first_loss": (lf_loss, hf_loss),
    }


def bench_checkpoint(name: str, workdir: Path, repeats: int = 3) -> dict:
    section = MODELS[name]
    model, _ = lmforge_model(section)
    opt = build_optimizer(validate_section("optimizer", ADAMW), model, LR)
    target = Checkpointable(model, opt)
    # The peer saves the same tensors as plain ones (the one process's DTensors hold them whole).
    tensors = {f"p{i}": p.to_local().detach().clone() for i, p in enumerate(model.parameters())}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                tensors[f"s{i}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sync_s, async_block_s, async_total_s, load_s, raw_save_s, raw_load_s = [], [], [], [], [], []
    for r in range(repeats):
        d = workdir / f"ck{r}"
        t0 = time.perf_counter()
        CheckpointManager(d / "sync").save(target, 1)
        sync_s.append(time.perf_counter() - t0)
        mgr = CheckpointManager(d / "async", async_save=True)
        t0 = time.perf_counter()
        mgr.save(target, 1)
        async_block_s.append(time.perf_counter() - t0)
        mgr.wait()
        async_total_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_checkpoint(resolve_checkpoint(d / "sync"), target, no_load_optim=False)
        load_s.append(time.perf_counter() - t0)
        raw = d / "raw.pt"
        t0 = time.perf_counter()
        torch.save(tensors, raw)
        with open(raw, "rb+") as f:
            os.fsync(f.fileno())  # our save fsyncs too
        raw_save_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(raw)
        raw_load_s.append(time.perf_counter() - t0)
        shutil.rmtree(d)
    med = statistics.median
    return {
        "name": name,
        "bytes": nbytes,
        "sync": med(sync_s),
        "async_block": med(async_block_s),
        "async_total": med(async_total_s),
        "load": med(load_s),
        "raw_save": med(raw_save_s),
        "raw_load": med(raw_load_s),
    }


MEMORY_VARIANTS = [
    ("loss", "plain", ["loss_plain"]),
    ("loss", "chunked 1024", ["loss_chunked", "--chunk", "1024"]),
    ("loss", "chunked 256", ["loss_chunked", "--chunk", "256"]),
    ("step", "lmforge, plain loss", ["step_lmforge", "--chunk", "0"]),
    ("step", "lmforge, loss_chunk_size 1024", ["step_lmforge", "--chunk", "1024"]),
    ("step", "lmforge, loss_chunk_size 256", ["step_lmforge", "--chunk", "256"]),
    ("step", "HF loop", ["step_hf"]),
]


def bench_memory() -> list[dict]:
    rows = []
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for kind, label, argv in MEMORY_VARIANTS:
        out = subprocess.run(
            [sys.executable, str(REPO / "bench" / "step_memory.py"), *argv],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append({"kind": kind, "label": label, **r})
        print(f"memory {kind} {label}: {r['extra_bytes'] / 2**30:.2f} GiB beyond inputs/states", flush=True)
    return rows


def memory_section(rows: list[dict], load: float) -> str:
    def gib(n: float) -> str:
        return f"{n / 2**30:.2f} GiB"

    plain_loss = next(r for r in rows if r["kind"] == "loss" and r["label"] == "plain")
    hf_step = next(r for r in rows if r["kind"] == "step" and r["label"] == "HF loop")
    lines = [
        "## Loss and step memory",
        "",
        f"`bench/train.py --only memory` (commit {commit()}). Machine: {machine()}. Load average at start: "
        f"{load:.1f}. Linux peak RSS (VmHWM) above the process's RSS before the measured work, one fresh "
        "process per row (`bench/step_memory.py`, under glibc's default allocator whatever the line above "
        "says of this process: freed large blocks go back to the system, so VmHWM follows the live peak). "
        "Seq 2048, vocabulary 151,936, hidden 1024 (Qwen3-0.6B).",
        "",
        "The output projection + cross-entropy alone (bf16, forward and backward; the input gradients "
        "are subtracted):",
        "",
        "| loss | peak beyond inputs | vs plain |",
        "|---|---:|---:|",
    ]
    for r in rows:
        if r["kind"] == "loss":
            lines.append(
                f"| {r['label']} | {gib(r['extra_bytes'])} | {r['extra_bytes'] / plain_loss['extra_bytes']:.2f}x |"
            )
    lines += [
        "",
        "A training step (second step, batch 1 x 2048) of a Qwen3-0.6B-shaped model cut to 2 layers "
        "(189M parameters, 155M of them the tied embedding): the peak minus parameters, fp32 gradients "
        "and optimizer states (lmforge: AdamW moments; HF loop: fp32 parameters, torch "
        "AdamW moments, autocast bf16):",
        "",
        "| step | peak | params | grads | optimizer states | beyond those | vs HF loop |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["kind"] == "step":
            lines.append(
                f"| {r['label']} | {gib(r['peak_bytes'])} | {gib(r['params_bytes'])} | {gib(r['grads_bytes'])} | "
                f"{gib(r['states_bytes'])} | {gib(r['extra_bytes'])} | {r['extra_bytes'] / hf_step['extra_bytes']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    return (
        f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY {policy}, allocator: {malloc.status}"
    )


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except Exception:
        return "?"


def throughput_section(rows: list[dict], load: float, steps: int, rounds: int) -> str:
    lines = [
        "## Training throughput",
        "",
        f"`bench/train.py` (commit {commit()}). Machine: {machine()}. Load average at start: {load:.1f} "
        "(shared machine: absolute numbers are noisy; the two loops alternate, so the ratio is the result).",
        f"Median of {rounds} x {steps} timed steps each, after one warm-up step. Same Qwen3 weights, random "
        "tokens, AdamW (0.9, 0.95, wd 0.01), clipping at 1.0. lmforge: the trainer's build (FSDP2 over one "
        "process: fp32 parameters, bf16 compute, fp32 gradients), the trainer's TrainStep. Peer: transformers Qwen3ForCausalLM, fp32 "
        "parameters + `torch.autocast(bfloat16)`, torch AdamW (fused=True). MFU against the bf16 matmul peak measured "
        "in the same run.",
        "",
        "| model | params | batch x seq | lmforge tokens/s | HF loop tokens/s | ratio | lmforge MFU | HF MFU | matmul peak |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['batch']} x {r['seq']} | {r['lf_tps']:,.0f} | "
            f"{r['hf_tps']:,.0f} | {r['lf_tps'] / r['hf_tps']:.2f}x | {100 * r['lf_mfu']:.1f}% | "
            f"{100 * r['hf_mfu']:.1f}% | {r['peak'] / 1e9:.0f} GFLOP/s |"
        )
    return "\n".join(lines) + "\n"


def checkpoint_section(rows: list[dict], load: float) -> str:
    lines = [
        "## Checkpoint save/load",
        "",
        f"`bench/train.py` (commit {commit()}), same machine (load average at start: {load:.1f}). The full training state of a model (weights "
        "at full precision, AdamW moments, RNG and counters) through `CheckpointManager` (DCP, fsync, "
        "atomic rename, tracker) against `torch.save` + fsync / `torch.load` of the same tensors on the "
        "same disk. Median of 3.",
        "",
        "| model | state | save (sync) | save (async: step blocked) | async until published | load | torch.save | torch.load | save ratio | load ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['bytes'] / 2**20:.0f} MiB | {r['sync']:.2f} s | {r['async_block']:.2f} s | "
            f"{r['async_total']:.2f} s | {r['load']:.2f} s | {r['raw_save']:.2f} s | {r['raw_load']:.2f} s | "
            f"{r['raw_save'] / r['sync']:.2f}x | {r['raw_load'] / r['load']:.2f}x |"
        )
    lines.append("")
    lines.append(
        "Ratios are peer time / lmforge time (above 1: lmforge is faster). A save also checks the weights"
    )
    lines.append(
        "are finite, writes common.json / config.yaml, fsyncs every file and directory and renames; an async"
    )
    lines.append(
        "save blocks the step only while DCP copies the state aside. Loading copies into the live tensors"
    )
    lines.append("and then through the optimizer's `load_state_dict` (which copies its state again).")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="demo,100m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--only",
        choices=["throughput", "checkpoint", "memory"],
        default=None,
        help="run (and rewrite) one part",
    )
    p.add_argument("--compile", action="store_true", help="also time both loops compiled (extra rows)")
    args = p.parse_args()
    malloc.apply_malloc_defaults()  # what `lmforge train` does at start; it applies to both loops
    load = os.getloadavg()[0]
    names = [n for n in args.models.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        variants = [(n, c) for n in names for c in ([False, True] if args.compile else [False])]
        for n, compiled in variants if args.only in (None, "throughput") else []:
            r = bench_throughput(n, args.steps, args.rounds, Path(tmp), compiled)
            print(
                f"{n}: lmforge {r['lf_tps']:,.0f} tok/s (MFU {100 * r['lf_mfu']:.1f}%), HF {r['hf_tps']:,.0f} tok/s "
                f"(MFU {100 * r['hf_mfu']:.1f}%), ratio {r['lf_tps'] / r['hf_tps']:.2f}x; first-step loss "
                f"{r['first_loss'][0]:.4f} vs {r['first_loss'][1]:.4f}",
                flush=True,
            )
            rows.append(r)
        ck = [bench_checkpoint(n, Path(tmp)) for n in names] if args.only in (None, "checkpoint") else []
        mem = bench_memory() if args.only in (None, "memory") else []
        for r in ck:
            print(
                f"{r['name']} checkpoint {r['bytes'] / 2**20:.0f} MiB: save {r['sync']:.2f}s (torch.save {r['raw_save']:.2f}s), "
                f"async blocks {r['async_block']:.2f}s, load {r['load']:.2f}s (torch.load {r['raw_load']:.2f}s)",
                flush=True,
            )
    if not args.no_write:
        text = DOC.read_text() if DOC.is_file() else "# Benchmarks\n"
        if rows:
            text = replace_section(
                text, "## Training throughput", throughput_section(rows, load, args.steps, args.rounds)
            )
        if ck:
            text = replace_section(text, "## Checkpoint save/load", checkpoint_section(ck, load))
        if mem:
            text = replace_section(text, "## Loss and step memory", memory_section(mem, load))
        DOC.write_text(text)
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
