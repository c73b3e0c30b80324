"""The CUDA paths CPU tests cannot reach, in one run on one GPU; writes one JSON results file.

    bench/gpu_check.sh [RESULTS.json]            # on a CUDA machine (< 8 min on an H100-class GPU)
    python bench/gpu_check.py --dry-run --out r.json   # tiny sizes on the CPU (the test suite runs this)

Every check runs even when an earlier one failed; each records ``status`` (ok / failed / skipped), its
numbers and, on failure, the error. The exit status is 1 when any check failed.

Checks: bf16 training of a Qwen3-shaped model (~0.6B on the GPU) eager, with regional compile and with
float8 (tokens/s, MFU against the datasheet peak, peak memory against lmforge's estimate); SDPA's
flash backend, and document attention over spans against the dense mask; ``torch._grouped_mm``
against lmforge's padded-bmm experts; activation swap (CUDA copies) against no swap; the profiler's
CUDA trace; AdamW against torch's fused AdamW and Muon against ``torch.optim.Muon``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.config import validate_section
from optim import make_params, time_pair  # bench/optim.py

# bf16 on the GPU; the CPU dry run computes in this CPU's native dtype (auto: float32 where bf16 is
# emulated, ~100x slower), so that it rehearses the script in seconds on any CPU.
QWEN3 = {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM", "compute_dtype": "bfloat16"}
# Qwen3-0.6B's shape (28 layers of 1024, 16 heads / 8 KV heads of 128, SwiGLU 3072, vocab 151,936).
GPU_MODEL = {
    **QWEN3,
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "seq_length": 2048,
    "tie_word_embeddings": True,
    "loss_chunk_size": 2048,
}
TINY_MODEL = {
    **QWEN3,
    "compute_dtype": "auto",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "seq_length": 64,
    "tie_word_embeddings": True,
    "loss_chunk_size": 32,
}


class Checks:
    def __init__(self, device: torch.device, dry_run: bool, compile_on_cpu: bool) -> None:
        self.device, self.dry_run, self.compile_on_cpu = device, dry_run, compile_on_cpu
        self.model_section = TINY_MODEL if dry_run else GPU_MODEL
        self.batch = 2 if dry_run else 4
        self.steps = 3 if dry_run else 10
        self.results: dict[str, dict] = {}

    def run(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            out = fn() or {}
            status = out.pop("status", "ok")
        except Exception as exc:  # a check's failure is a result, the others still run
            out, status = (
                {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]},
                "failed",
            )
        out.update(status=status, seconds=round(time.perf_counter() - t0, 2))
        self.results[name] = out
        print(
            f"{name}: {status} ({out['seconds']} s) {json.dumps({k: v for k, v in out.items() if k != 'trace'})[:300]}",
            flush=True,
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    # ---- training ---------------------------------------------------------------------------
    def train(self, compile_blocks: bool = False, float8: bool = False) -> dict:
        from lmforge.config.sections_speed import CompileConfig, Float8Config
        from lmforge.optim import build_optimizer
        from lmforge.parallel import compile as regional
        from lmforge.parallel.float8 import apply_float8, check_float8_supported
        from lmforge.train.builder import build_training_model
        from lmforge.train.perf import mfu_peak
        from lmforge.train.step import TrainStep

        if compile_blocks and self.device.type == "cpu" and not self.compile_on_cpu:
            return {"status": "skipped", "why": "compile on CPU is slow; pass --compile-on-cpu"}
        f8 = Float8Config(enable=True, emulate=self.device.type != "cuda", recipe="tensorwise")
        if float8:
            check_float8_supported(f8, self.device)
        self.reset_memory()
        torch.manual_seed(0)

        def before_fsdp(model):
            # Float8 layers first, then compiled blocks, both before FSDP2 wraps them (as build_trainer).
            if float8:
                apply_float8(model, f8)
            if compile_blocks:
                regional.compile_blocks(model, CompileConfig(enable=True))

        # The trainer's one build path: meta, FSDP2 over this one process (fp32 parameters), init.
        model, ctx = build_training_model(
            validate_section("model", self.model_section),
            seed=0,
            device=str(self.device),
            before_fsdp=before_fsdp,
        )
        opt = build_optimizer(
            validate_section("optimizer", {"type": "AdamW", "betas": [0.9, 0.95], "weight_decay": 0.01}),
            model,
            1e-4,
        )
        step = TrainStep(model, opt, None, max_norm=1.0, ctx=ctx)
        s, v = self.model_section["seq_length"], self.model_section["vocab_size"]
        g = torch.Generator().manual_seed(0)
        full = torch.randint(0, v, (self.batch, s + 1), generator=g).to(self.device)
        batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].contiguous()}
        t0 = time.perf_counter()
        first = step([batch]).loss
        self.sync()
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            last = step([batch]).loss
            self.sync()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times)[len(times) // 2]
        tokens_per_s = self.batch * s / step_s
        peak = mfu_peak(self.device, model.compute_dtype)
        out = {
            "compute_dtype": str(model.compute_dtype).removeprefix("torch."),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "first_step_s": round(first_s, 2),
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens_per_s),
            "mfu": round(model.flops_per_token(s) * tokens_per_s / peak.flops, 4),
            "mfu_denominator": peak.source,
            "loss_first_last": [round(first, 4), round(last, 4)],
        }
        if compile_blocks:
            out["compile_s"] = round(regional.compile_seconds(), 1)
        if self.device.type == "cuda":
            out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
            out["estimate_gib"] = round(self.memory_estimate() / 2**30, 2)
        return out

    def memory_estimate(self) -> int:
        from lmforge.config.sections_parallel import ParallelismConfig
        from lmforge.models import build_model
        from lmforge.parallel import ParallelDims
        from lmforge.tools.memory import estimate_memory

        sec = self.model_section
        meta = build_model(validate_section("model", sec), device="meta")
        est = estimate_memory(
            meta,
            ParallelDims.from_section(ParallelismConfig(), 1),
            compute_dtype=meta.compute_dtype,
            optimizer_type="AdamW",
            seq_length=sec["seq_length"],
            local_batch_size=self.batch,
            hidden_size=sec["hidden_size"],
            num_layers=sec["num_hidden_layers"],
            vocab_size=sec["vocab_size"],
        )
        return est.total()

    # ---- attention ----------------------------------------------------------------------------
    def attention(self) -> dict:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from lmforge.models.common.attention import segment_attention
        from lmforge.models.common.masks import build_allowed_mask, document_spans

        b, h, s, d = (2, 4, 128, 16) if self.dry_run else (4, 16, 4096, 128)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        q, k, v = (
            torch.randn(b, h, s, d, device=self.device, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        out: dict = {}
        if self.device.type == "cuda":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            out["flash_backend"] = "ok"
        ends = torch.tensor([s // 8, s // 3, s // 2, s], device=self.device)
        dense = build_allowed_mask(s, self.device, None, ends)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        got = segment_attention(q, k, v, document_spans(ends, s), d**-0.5)
        out["segments_vs_dense_max_abs"] = float((got.detach().float() - ref.detach().float()).abs().max())
        if out["segments_vs_dense_max_abs"] > (1e-5 if dtype == torch.float32 else 2e-2):
            out["status"] = "failed"
        if hasattr(torch.nn.attention, "varlen") or hasattr(torch.nn.attention, "varlen_attn"):
            out["torch_varlen_available"] = True
        return out

    def grouped_mm(self) -> dict:
        from lmforge.models.common.moe import grouped_matmul

        if not hasattr(torch, "_grouped_mm"):
            return {"status": "skipped", "why": "torch._grouped_mm is missing in this torch"}
        e, k, n = (4, 32, 48) if self.dry_run else (64, 2048, 1536)
        counts = torch.tensor([16 * (i % 3 + 1) for i in range(e)], device=self.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        x = torch.randn(int(counts.sum()), k, device=self.device, dtype=dtype)
        w = torch.randn(e, n, k, device=self.device, dtype=dtype) * 0.05
        ref = grouped_matmul(x, w, counts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        out = {"rel_err_vs_padded_bmm": err, "status": "ok" if err < 2e-2 else "failed"}
        if self.device.type == "cuda":  # the backward too (this CPU build rejects unaligned shapes there)
            grads = []
            for fn in (
                lambda a, b: grouped_matmul(a, b, counts),
                lambda a, b: torch._grouped_mm(a, b.transpose(1, 2), offs=offs),
            ):
                a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
                fn(a, b).float().square().sum().backward()
                grads.append((a.grad.float(), b.grad.float()))
            gerr = max(
                float((p - q).abs().max() / q.abs().max()) for p, q in zip(grads[1], grads[0], strict=True)
            )
            out["grad_rel_err_vs_padded_bmm"] = gerr
            if gerr > 2e-2:
                out["status"] = "failed"
        return out

    def swap(self) -> dict:
        from lmforge.config.sections_parallel import SwapConfig
        from lmforge.models import build_model
        from lmforge.parallel.activation import apply_activation_memory

        if self.device.type != "cuda":
            return {"status": "skipped", "why": "activation swap copies to the host only from a GPU"}
        section = {**TINY_MODEL, "num_hidden_layers": 4, "compute_dtype": "float32"}
        ids = torch.randint(0, section["vocab_size"], (2, 64), device=self.device)
        grads = []
        for swap in (False, True):
            torch.manual_seed(0)
            model = build_model(validate_section("model", section), device=self.device)
            if swap:
                cfg = SwapConfig(enable=True, layer_swap=[{"layers": ["0-2"]}])
                apply_activation_memory(model, None, None, cfg, section["num_hidden_layers"])
            model(ids, labels=ids).loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        err = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
        return {"max_abs_grad_diff": err, "status": "ok" if err < 1e-5 else "failed"}

    def profiler(self) -> dict:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        x = torch.randn(256, 256, device=self.device)
        with profile(activities=activities) as prof:
            (x @ x).sum().item()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
        kernels = sum(1 for e in events if e.get("cat") in ("kernel", "gpu_memcpy"))
        out = {"events": len(events), "cuda_kernel_events": kernels}
        if self.device.type == "cuda" and kernels == 0:
            out["status"] = "failed"
        return out

    def optimizers(self) -> dict:
        from lmforge.optim import AdamW, Muon

        shapes = [(256, 256)] * 4 if self.dry_run else [(4096, 1024)] * 8 + [(1024, 3072)] * 8
        repeats = 3 if self.dry_run else 10
        out = {}

        def params(dtype):
            return [p.to(self.device) for p in make_params(shapes, dtype)]

        a, b = params(torch.float32), params(torch.float32)
        a = [torch.nn.Parameter(p) for p in a]
        b = [torch.nn.Parameter(p) for p in b]
        ours, theirs, ratio, _cpu_ratio = time_pair(
            lambda: AdamW(a, lr=1e-3, weight_decay=0.1),
            lambda: torch.optim.AdamW(b, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True),
            a,
            b,
            repeats,
        )
        out["adamw_vs_torch_fused"] = round(ratio, 3)
        ours, theirs, ratio, _cpu_ratio = time_pair(
            lambda: Muon(a, lr=0.02, qk_clip_enabled=False),
            lambda: torch.optim.Muon(b, lr=0.02, adjust_lr_fn="match_rms_adamw"),
            a,
            b,
            repeats,
        )
        out["muon_vs_torch_muon"] = round(ratio, 3)
        return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes; runs on the CPU when there is no GPU")
    p.add_argument(
        "--compile-on-cpu", action="store_true", help="also run the compiled training check on a CPU"
    )
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.dry_run:
        print("gpu_check: no CUDA device; run with --dry-run for the CPU rehearsal", flush=True)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    checks = Checks(device, a.dry_run, a.compile_on_cpu)
    checks.run("train_eager", checks.train)
    checks.run("train_compile", lambda: checks.train(compile_blocks=True))
    checks.run("train_float8", lambda: checks.train(float8=True))
    checks.run("attention", checks.attention)
    checks.run("grouped_mm", checks.grouped_mm)
    checks.run("swap", checks.swap)
    checks.run("profiler", checks.profiler)
    checks.run("optimizers", checks.optimizers)
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dry_run": a.dry_run,
        "checks": checks.results,
    }
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    failed = [k for k, v in checks.results.items() if v["status"] == "failed"]
    print(f"gpu_check: wrote {a.out}; failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
