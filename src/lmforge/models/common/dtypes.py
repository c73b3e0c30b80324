"""Dtype names as the original writes them (``bfloat16``, ``bf16``, ``fp32`` ...) to torch dtypes."""

from __future__ import annotations

import torch

from lmforge.errors import ConfigError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: object, key: str) -> torch.dtype:
    """``value`` (a name or a torch dtype) as a torch floating dtype; ``key`` names it in errors."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(
        f"{key} = {value!r} is not a dtype lmforge knows; valid values: 'float32' (fp32), 'bfloat16' (bf16), "
        "'float16' (fp16)."
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
