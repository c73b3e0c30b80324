"""The MFU denominator (train/perf.py)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.sections_speed import MfuConfig
from lmforge.train.perf import datasheet_peak_tflops, mfu_peak


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA B200", 2250.0),
        ("AMD Instinct MI300X", 1307.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_table(name, tflops):
    assert datasheet_peak_tflops(name) == tflops


def test_cpu_uses_the_measured_peak_and_says_so():
    peak = mfu_peak(torch.device("cpu"), torch.float32)
    assert peak.flops > 1e8
    assert peak.source.startswith("measured float32 matmul peak of this cpu")


def test_override_wins_and_is_validated():
    peak = mfu_peak(torch.device("cpu"), torch.float32, 123.0)
    assert peak.flops == 123e12 and "mfu.peak_tflops" in peak.source
    with pytest.raises(ValueError, match="mfu.peak_tflops"):
        MfuConfig(peak_tflops=0.0)


def test_the_denominator_is_the_peak_of_the_compute_dtype_not_of_the_fp32_masters(monkeypatch):
    from types import SimpleNamespace

    from lmforge.train import perf

    asked = []

    def fake_peak(device, dtype, override=None):
        asked.append(dtype)
        return SimpleNamespace(flops=1e12, source="test")

    monkeypatch.setattr(perf, "mfu_peak", fake_peak)
    model = torch.nn.Linear(2, 2)  # fp32 parameters, as the masters are
    model.compute_dtype = torch.bfloat16
    meter = perf.MfuMeter(model, torch.device("cpu"))
    assert meter.peak() == 1e12 and meter.peak() == 1e12
    assert asked == [torch.bfloat16]  # worked out once


def test_a_16_bit_peak_is_measured_in_that_dtype_and_says_so():
    peak = mfu_peak(torch.device("cpu"), torch.bfloat16)
    assert peak.flops > 0
    assert peak.source.startswith(
        "measured bfloat16 matmul peak of this cpu (the model computes in bfloat16)"
    )
