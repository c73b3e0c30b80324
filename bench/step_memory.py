"""One memory measurement per process (called by ``bench/train.py --only memory``; prints one JSON line).

    python bench/step_memory.py VARIANT [--chunk N]

Variants: ``loss_plain`` / ``loss_chunked`` (the output projection + cross-entropy alone, forward and
backward, hidden 1024, seq 2048, vocab 151,936, bf16); ``step_lmforge`` / ``step_hf`` (two training
steps of a Qwen3-0.6B-shaped model cut to 2 layers: lmforge's TrainStep and AdamW with fp32 masters,
with ``loss_chunk_size`` = ``--chunk`` (0: plain), against the plain Hugging Face loop).

Memory is the Linux peak resident set (VmHWM) of this process above its RSS before anything was
built, in a fresh process per variant (so no allocator cache is shared). For the steps it is measured
over the second step and the parameters, gradients (fp32 for both) and optimizer states are
subtracted: what remains is activations, logits and temporaries.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.config import validate_section

SEQ, VOCAB, HIDDEN = 2048, 151936, 1024
QWEN3_06B_2L = {
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "compute_dtype": "bfloat16",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "seq_length": SEQ,
    "tie_word_embeddings": True,
}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


def peak() -> int:
    return _status("VmHWM:")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def loss_only(chunk: int) -> dict:
    from lmforge.models.common.loss import chunked_linear_cross_entropy, token_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQ, HIDDEN, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (SEQ,), generator=g)
    base = reset_peak()
    if chunk:
        loss, n = chunked_linear_cross_entropy(hidden, weight, labels, None, chunk)
    else:
        loss, n = token_cross_entropy(F.linear(hidden, weight), labels, None)
    (loss / n).backward()
    # the gradients of the inputs are outputs, not the loss's working memory
    extra = peak() - base - nbytes([hidden.grad, weight.grad])
    return {"extra_bytes": extra, "loss": float(loss / n)}


def step_lmforge(chunk: int) -> dict:
    from lmforge.optim import build_optimizer
    from lmforge.train.builder import build_training_model
    from lmforge.train.step import TrainStep

    start = reset_peak()
    torch.manual_seed(0)
    # The trainer's build: FSDP2 over this one process, fp32 parameters (the masters), bf16 compute.
    model, ctx = build_training_model(
        validate_section("model", {**QWEN3_06B_2L, "loss_chunk_size": chunk}), seed=0, device="cpu"
    )
    opt = build_optimizer(
        validate_section(
            "optimizer", {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
        ),
        model,
        1e-4,
    )
    step = TrainStep(model, opt, None, max_norm=1.0, ctx=ctx)
    batch = _batch()
    batch = {"input_ids": batch[:, :-1], "labels": batch[:, 1:].clone()}
    first = step([batch]).loss
    reset_peak()
    step([batch])
    params = list(model.parameters())
    grads = nbytes([g for p in params if (g := p.grad) is not None]) or 4 * sum(p.numel() for p in params)
    states = nbytes([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0])
    return _result(
        peak() - start, nbytes(params), max(grads, 4 * sum(p.numel() for p in params)), states, first
    )


def step_hf() -> dict:
    import transformers

    from lmforge.models import build_model, save_hf_pretrained

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_pretrained(build_model(validate_section("model", QWEN3_06B_2L)), Path(tmp))
        gc.collect()
        start = reset_peak()
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    ids = _batch()[:, :-1]

    def one() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    first = one()
    reset_peak()
    one()
    params = list(model.parameters())
    states = nbytes([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0])
    return _result(peak() - start, nbytes(params), 4 * sum(p.numel() for p in params), states, first)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _result(total: int, params: int, grads: int, states: int, loss: float) -> dict:
    return {
        "peak_bytes": total,
        "params_bytes": params,
        "grads_bytes": grads,
        "states_bytes": states,
        "extra_bytes": total - params - grads - states,
        "loss": loss,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("variant", choices=["loss_plain", "loss_chunked", "step_lmforge", "step_hf"])
    p.add_argument("--chunk", type=int, default=1024)
    a = p.parse_args()
    if a.variant == "loss_plain":
        out = loss_only(0)
    elif a.variant == "loss_chunked":
        out = loss_only(a.chunk)
    elif a.variant == "step_lmforge":
        out = step_lmforge(a.chunk)
    else:
        out = step_hf()
    print(json.dumps(out), file=sys.stdout, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
