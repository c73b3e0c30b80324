"""Float8 Linear layers via torchao (parallel/float8.py), checked in torchao's emulation mode on CPU."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.sections_speed import Float8Config
from lmforge.errors import ConfigError
from lmforge.parallel.float8 import apply_float8, check_float8_supported
from tiny_fp32 import tiny_model

pytest.importorskip("torchao.float8")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _fake_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Tensorwise dynamic scaling to e4m3 and back (the recipe's forward rounding, written out)."""
    scale = E4M3_MAX / t.abs().max().double().clamp(min=1e-12)
    scale = scale.float()
    return ((t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()) / scale


def test_converted_layers_and_forward_match_the_float8_rounding():
    model = tiny_model("qwen3")
    names = list(model.state_dict())
    n = apply_float8(model, Float8Config(enable=True, emulate=True))
    from torchao.float8.float8_linear import Float8Linear

    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert n == len(converted) == 2 * 4  # 4 Linear layers in each of 2 blocks; output layer skipped
    assert not any("output_layer" in name for name in converted)
    assert list(model.state_dict()) == names
    layer = model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(5, 64)
    expected = _fake_e4m3(x) @ _fake_e4m3(layer.weight.detach()).t()
    got = layer(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    # and it is not the high-precision result
    assert not torch.allclose(got, x @ layer.weight.detach().t(), rtol=1e-4, atol=1e-4)


def test_emulated_rowwise_loss_is_close_to_fp32_and_trains():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = tiny_model("qwen3")
    f8 = tiny_model("qwen3")
    apply_float8(f8, Float8Config(enable=True, emulate=True, recipe="rowwise"))
    a, b = ref(ids, labels=ids).loss, f8(ids, labels=ids).loss
    b.backward()
    assert abs(a.item() - b.item()) / a.item() < 0.02
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in f8.parameters() if p.requires_grad
    )


def test_refused_without_float8_hardware():
    with pytest.raises(ConfigError, match="float8.enable: true needs a CUDA GPU"):
        check_float8_supported(Float8Config(enable=True), torch.device("cpu"))
    with pytest.raises(ConfigError, match="tensor_parallel"):
        check_float8_supported(
            Float8Config(enable=True, emulate=True), torch.device("cpu"), tensor_parallel=2
        )
    check_float8_supported(Float8Config(enable=True, emulate=True), torch.device("cpu"))
    with pytest.raises(ValueError, match="float8.recipe"):
        Float8Config(enable=True, recipe="mxfp8")
