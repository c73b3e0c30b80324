"""``model.compute_dtype: auto`` and the warning for an emulated 16-bit dtype (utils/native_dtype.py).

The decisions are tested with the capability probe and the measurement replaced (so that both kinds of
CPU of these machines take every branch), and once for real in a subprocess whose oneDNN is limited to
AVX2: there bf16 is emulated on any x86-64 CPU, which is what a CPU without AVX512_BF16/AMX does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.utils import native_dtype
from lmforge.utils.native_dtype import choose_compute_dtype, emulation_warning

REPO = Path(__file__).resolve().parents[2]
# oneDNN (torch's CPU matmuls) and ATen's kernels limited to AVX2: bf16 emulated, as on an AVX2-only CPU.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture
def cpu(monkeypatch):
    """Set what the CPU reports and what the measurement finds."""

    def configure(capable: bool, ratio: float) -> None:
        monkeypatch.setattr(native_dtype, "cpu_capability", lambda dtype: capable or dtype == torch.float32)
        monkeypatch.setattr(native_dtype, "cpu_speed_ratio", lambda dtype: (ratio * 100.0, ratio))

    return configure


def test_auto_is_bf16_where_capable_and_measured_fast(cpu):
    cpu(capable=True, ratio=2.0)
    choice = choose_compute_dtype("auto", "cpu")
    assert choice.dtype == torch.bfloat16 and choice.is_auto
    assert "natively" in choice.reason and "2.0x" in choice.reason


def test_auto_is_float32_without_the_capability(cpu):
    cpu(capable=False, ratio=2.0)  # the measurement is not even asked
    choice = choose_compute_dtype("auto", "cpu")
    assert choice.dtype == torch.float32
    assert "no native bf16" in choice.reason


def test_auto_is_float32_when_the_measurement_contradicts_the_capability(cpu):
    cpu(capable=True, ratio=0.02)
    choice = choose_compute_dtype("auto", "cpu")
    assert choice.dtype == torch.float32 and "0.02x" in choice.reason


def test_auto_on_cuda_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native_dtype, "cuda_native", lambda dtype: False)
    assert choose_compute_dtype("auto", "cuda").dtype == torch.float32
    monkeypatch.setattr(native_dtype, "cuda_native", lambda dtype: True)
    assert choose_compute_dtype("auto", "cuda").dtype == torch.bfloat16


def test_explicit_dtype_is_kept(cpu):
    cpu(capable=False, ratio=0.01)
    choice = choose_compute_dtype(torch.bfloat16, "cpu")
    assert choice.dtype == torch.bfloat16 and not choice.is_auto


def test_emulated_explicit_dtype_warns_with_the_slowdown_and_the_key(cpu):
    cpu(capable=False, ratio=0.02)
    text = emulation_warning(torch.bfloat16, "cpu")
    assert "model.compute_dtype = bfloat16" in text
    assert "50x slower" in text
    assert "model.compute_dtype: auto" in text


def test_native_or_float32_draws_no_warning(cpu):
    cpu(capable=True, ratio=2.0)
    assert emulation_warning(torch.bfloat16, "cpu") is None
    cpu(capable=False, ratio=0.01)
    assert emulation_warning(torch.float32, "cpu") is None


def test_the_real_measurement_orders_float32_and_an_emulated_dtype():
    # float16 has no native CPU path on these machines' CPUs; float32 must come out faster.
    if native_dtype.cpu_capability(torch.float16):
        pytest.skip("this CPU computes float16 natively")
    gflops, ratio = native_dtype.cpu_speed_ratio(torch.float16)
    assert gflops > 0 and ratio < 1.0


def _check(config: str, *sets: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "lmforge", "check", "--config", config, "--device", "cpu"]
    for item in sets:
        args += ["--set", item]
    full_env = dict(os.environ, PYTHONPATH=str(REPO / "src"), **(env or {}))
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_check_on_an_avx2_cpu_chooses_float32_and_warns_about_explicit_bf16():
    auto = _check("configs/demo.yaml", env=AVX2_ONLY)
    assert auto.returncode == 0, auto.stderr
    assert (
        "compute dtype on cpu: model.compute_dtype = float32 (auto: this CPU has no native bf16"
        in auto.stdout
    )
    explicit = _check("configs/demo.yaml", "model.compute_dtype=bfloat16", env=AVX2_ONLY)
    assert explicit.returncode == 0, explicit.stderr
    assert "model.compute_dtype = bfloat16 (as configured)" in explicit.stdout
    assert "emulates them" in explicit.stdout and "set model.compute_dtype: auto" in explicit.stdout


@pytest.mark.slow
def test_check_on_this_cpu_says_what_auto_chose():
    result = _check("configs/demo.yaml")
    assert result.returncode == 0, result.stderr
    expected = choose_compute_dtype("auto", "cpu").dtype
    name = str(expected).removeprefix("torch.")
    assert f"compute dtype on cpu: model.compute_dtype = {name} (auto: " in result.stdout


def test_a_bad_compute_dtype_names_auto_among_the_valid_values(base_config):
    from lmforge.config import load_config
    from lmforge.errors import ConfigError

    base_config["model"]["compute_dtype"] = "bfloat17"
    with pytest.raises(ConfigError, match="model.compute_dtype.*'auto'"):
        load_config(base_config)
