"""Chunked cross-entropy under tensor parallel: vocabulary-parallel (logits never gathered), 2 gloo ranks."""

from __future__ import annotations

import pytest

from parallel import test_parity as parity  # tests/parallel/test_parity.py (its harness and models)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_tp_chunked_loss_matches_single_process(tmp_path, monkeypatch):
    models = dict(parity.MODELS)
    models["llama_chunked"] = lambda: parity.MODELS["llama"]() | {"loss_chunk_size": 24}
    models["llama_tied_chunked"] = lambda: parity.MODELS["llama_tied"]() | {"loss_chunk_size": 5}
    models["deepseek_mtp_chunked"] = lambda: parity.MODELS["deepseek_mtp"]() | {"loss_chunk_size": 7}
    monkeypatch.setattr(parity, "MODELS", models)
    cases = [
        parity._case("tp_chunked", "llama_chunked", tensor_parallel=2),
        parity._case("tp_tied_chunked", "llama_tied_chunked", tensor_parallel=2),
        parity._case("tp_mtp_chunked", "deepseek_mtp_chunked", tensor_parallel=2),
    ]
    parity._run_cases(cases, 2, tmp_path)
