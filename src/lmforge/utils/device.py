"""Checking ``--device`` and torchrun's environment before any work (a typo must not train on CPU)."""

from __future__ import annotations

import os

import torch

from lmforge.errors import ConfigError

SUPPORTED = ("cpu", "cuda")


def parse_device(name: str | None, flag: str = "--device") -> str | None:
    """``name`` checked: ``cpu``, ``cuda`` or ``cuda:N`` on a machine that has it (None: the default)."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in SUPPORTED:
        raise ConfigError(f"{flag} {name!r} is not a device lmforge runs on; use one of: cpu, cuda, cuda:N.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag} {name!r}: this machine has no usable CUDA device; use --device cpu.")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"{flag} {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}."
            )
    return str(device)


def run_device_type(device: str | None) -> str:
    """The device type a run on this machine uses: ``--device`` when given, else ``cuda`` when CUDA is
    available, else ``cpu``. Known before anything is built (preflight decides device-dependent
    settings with it; ``distributed_env`` places the run on it)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer from torchrun's environment (``WORLD_SIZE``, ``RANK``, ...), checked."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(
            f"The environment variable {name}={raw!r} must be an integer >= {minimum} (torchrun sets it); "
            f"unset it to run in one process."
        )
    return value
