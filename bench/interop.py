"""Hugging Face export and harness scoring against their transformers peers, side by side.

    .venv/bin/python bench/interop.py [--rounds N] [--no-write]

* Export: ``save_hf_pretrained`` (name mapping, sharded safetensors through torch's
  ``HuggingFaceStorageWriter``, index, config) vs transformers' own ``save_pretrained`` of the same
  weights (loaded from our export), same shard limit, same disk.
* Harness scoring: ``LmforgeLM.loglikelihood`` (lmforge's model as the lm-evaluation-harness model)
  vs the harness's ``HFLM`` on the exported weights: the same requests, batch size 8, fp32 on CPU.

Each round runs ours then the peer; times are medians, the ratio is the median of the per-round
ratios. The table replaces the "## Interop: HF export, harness scoring" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchdoc import write_section
from lmforge.config import validate_section
from lmforge.models import build_model, save_hf_pretrained
from lmforge.train.callbacks.lm_eval_harness import LmforgeLM

SECTION = "## Interop: HF export, harness scoring"
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "he",
    "shall",
    "unto",
    "for",
    "his",
    "a",
    "lord",
    "they",
    "be",
    "is",
    "him",
    "not",
    "them",
    "it",
    "with",
    "all",
    "thou",
]
EXPORT_MODEL = {  # ~34M parameters (~135 MB in fp32): big enough that writing dominates
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "compute_dtype": "float32",
}
SCORE_MODEL = {
    **EXPORT_MODEL,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "seq_length": 256,
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return tok


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_export(work: Path, rounds: int) -> tuple[float, float, float]:
    import transformers

    torch.manual_seed(0)
    model = build_model(validate_section("model", EXPORT_MODEL))
    save_hf_pretrained(model, work / "ref", max_shard_size="50MB")
    peer = transformers.AutoModelForCausalLM.from_pretrained(work / "ref")
    ours_t, peer_t, ratios = [], [], []
    for r in range(rounds):
        a = timed(lambda r=r: save_hf_pretrained(model, work / f"ours{r}", max_shard_size="50MB"))
        b = timed(lambda r=r: peer.save_pretrained(work / f"peer{r}", max_shard_size="50MB"))
        ours_t.append(a), peer_t.append(b), ratios.append(a / b)
        shutil.rmtree(work / f"ours{r}"), shutil.rmtree(work / f"peer{r}")
    return statistics.median(ours_t), statistics.median(peer_t), statistics.median(ratios)


def bench_scoring(work: Path, rounds: int, n: int = 96) -> tuple[float, float, float]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    tok = make_tokenizer(work / "tok")
    torch.manual_seed(0)
    model = build_model(validate_section("model", SCORE_MODEL))
    save_hf_pretrained(model, work / "score_hf", tokenizer=work / "tok")
    rng = random.Random(1)
    pairs = [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120))), " " + rng.choice(WORDS))
        for _ in range(n)
    ]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    ours = LmforgeLM(model, tok, eot_id=0, max_length=256, batch_size=8)
    peer = HFLM(
        pretrained=str(work / "score_hf"), device="cpu", dtype="float32", batch_size=8, max_length=256
    )
    ours_t, peer_t, ratios = [], [], []
    for _ in range(rounds):
        a = timed(lambda: ours.loglikelihood(reqs, disable_tqdm=True))
        b = timed(lambda: peer.loglikelihood(reqs, disable_tqdm=True))
        ours_t.append(n / a), peer_t.append(n / b), ratios.append((n / a) / (n / b))
    return statistics.median(ours_t), statistics.median(peer_t), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-interop-") as tmp:
        export = bench_export(Path(tmp), args.rounds)
        scoring = bench_scoring(Path(tmp), args.rounds)
    body = f"""{SECTION}

`bench/interop.py` ({args.rounds} rounds, ours then the peer in each, one process; times are medians, the
ratio is the median of the per-round ratios; commit {commit}). Machine: {machine()}. Load average at
start: {load:.1f} (shared machine: absolute numbers are noisy, the ratio is the result).

| what | ours | peer | ours | peer | ratio |
|---|---|---|---:|---:|---:|
| HF export, 34M-parameter Qwen3, fp32, 50MB shards | `save_hf_pretrained` (DCP `HuggingFaceStorageWriter`) | transformers `save_pretrained` | {export[0]:.2f} s | {export[1]:.2f} s | {export[2]:.2f}x time |
| harness log-likelihood, 96 requests of 60-120 words, batch 8 | `LmforgeLM` (lmforge model) | lm-eval `HFLM` (same weights, transformers) | {scoring[0]:.1f} req/s | {scoring[1]:.1f} req/s | {scoring[2]:.2f}x throughput |

Reading: the export's time is mostly torch's `HuggingFaceStorageWriter`, which serializes each
shard into an in-memory buffer and then writes it (a profile of one export: 1.55 s of 1.62 s in
the writer, 1.03 s of it in the buffered write); the same files written by `safetensors.save_file`
(lmforge's fallback path for a torch without the writer) took about a third of that. The name
mapping and copies cost about 0.03 s. The harness rows run the same model math (parity within
1e-4, tests/end_to_end/interop/test_downstream_eval.py); both sort requests longest first and batch 8.
"""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
