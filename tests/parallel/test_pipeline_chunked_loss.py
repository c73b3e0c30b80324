"""Pipeline parallel computes the loss with the chunked linear cross-entropy: no ``[tokens, vocab]`` logits.

Two gloo ranks, 1F1B, a tiny Llama with a large vocabulary (4,096 against hidden 32, 128 tokens per
micro-batch). The same weights and batch run one pipelined forward/backward and one evaluation with
``loss_chunk_size: 0`` (plain) and ``16``. On the last stage, a TorchDispatchMode records the largest fp32
tensor any operation returns: with chunking it stays below ``tokens × vocab`` (the chunk's logits are
16 × 4,096); with the plain loss the whole logits appear, which shows the check can fail. Loss and every
gradient of the chunked run equal the plain run's within 1e-6 relative (fp32).
"""

from __future__ import annotations

import pytest
import torch

from .harness import make_data, run_workers, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(120)]

SEQ, GBS, VOCAB, CHUNK = 128, 2, 4096, 16


def test_pipelined_chunked_loss_never_holds_the_logits_and_matches_the_plain_loss(tmp_path):
    section = tiny_llama(vocab_size=VOCAB, num_hidden_layers=2)
    torch.save(make_data(1, GBS, SEQ, VOCAB), tmp_path / "data.pt")
    spec = {
        "task": "pipeline_loss_task",
        "model": section,
        "parallelism": {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"},
        "data": str(tmp_path / "data.pt"),
        "gbs": GBS,
        "lbs": 1,
        "chunks": [0, CHUNK],
    }
    results = run_workers(2, spec, timeout=100)
    logits = SEQ * VOCAB  # one micro-batch's [tokens, vocab]
    last = [r for r in results if r["0"]["last_stage"]]
    assert len(last) == 1
    plain, chunked = last[0]["0"], last[0][str(CHUNK)]
    assert plain["largest_fp32_train"][0] >= logits, plain["largest_fp32_train"]
    assert plain["largest_fp32_eval"][0] >= logits, plain["largest_fp32_eval"]
    assert chunked["largest_fp32_train"][0] < logits, chunked["largest_fp32_train"]
    assert chunked["largest_fp32_eval"][0] < logits, chunked["largest_fp32_eval"]
    for res in results:
        plain, chunked = res["0"], res[str(CHUNK)]
        assert chunked["tokens"] == plain["tokens"]
        assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        assert chunked["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
        assert chunked["grad_rel_diff"], "no gradients on this rank"
        worst = max(chunked["grad_rel_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, f"gradient of {worst[0]}: {worst[1]:.2e} relative to the plain loss"
