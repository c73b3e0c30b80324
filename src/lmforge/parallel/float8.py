"""Float8 training of the Linear layers with torchao (``float8:`` section, optional extra ``[float8]``).

Each selected ``nn.Linear`` becomes torchao's ``Float8Linear``: inputs, weights and output gradients
are cast to float8 (e4m3 forward, e5m2 gradients for ``tensorwise``; e4m3 with per-row scales for
``rowwise``) with dynamic scaling, and the matmuls run on float8 tensor cores; parameters, optimizer
states and everything else keep their dtypes. It is applied right after the model is built, before
recompute, compile and FSDP2 (torchtitan's order, in which torchao's float8 composes with both; only
the single-process path is tested here, in emulation). ``emulate: true`` runs torchao's emulation
(float8 rounding, matmuls in high precision) so the path can be tested without float8 hardware.

Not converted: layers whose qualified name contains an entry of ``float8.skip`` (by default the output
layer, the MoE router and the MTP projection, which want full precision) and layers whose dimensions
are not multiples of 16 (the float8 matmul's requirement). Grouped experts are not Linear layers and
stay in bf16.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmforge.config.sections_speed import Float8Config
from lmforge.errors import ConfigError

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have float8 tensor cores


def check_float8_supported(section: Float8Config, device: torch.device, tensor_parallel: int = 1) -> None:
    """Refuse, before anything is built, a float8 setting this run cannot honour."""
    if not section.enable:
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "float8.enable: true needs torchao, which is not installed: pip install 'lmforge[float8]' "
            f"(or pip install torchao). Import error: {exc}"
        ) from None
    if tensor_parallel > 1:
        raise ConfigError(
            "float8.enable: true cannot be combined with parallelism.tensor_parallel > 1 yet: lmforge's tensor "
            "parallel replaces the Linear layers' forward, which would silently drop float8. Use FSDP "
            "(data_parallel_shard) or set float8.enable: false."
        )
    if section.emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"float8.enable: true needs a CUDA GPU with float8 tensor cores (compute capability 8.9 or newer: "
            f"L4, L40, H100, H200, B200); this run's device is {device.type}. Set float8.enable: false, or "
            "float8.emulate: true to run torchao's (slow) emulation for testing."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"float8.enable: true needs compute capability 8.9 or newer (float8 tensor cores); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Set float8.enable: false."
        )


def _selected(skip: list[str]):
    def select(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(s in fqn for s in skip):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return select


def apply_float8(model: nn.Module, section: Float8Config) -> int:
    """Swap the selected Linear layers for torchao Float8Linear in place; returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(section.recipe)
    if section.emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    select = _selected(list(section.skip))
    count = sum(1 for fqn, m in model.named_modules() if select(m, fqn))
    convert_to_float8_training(model, config=config, module_filter_fn=select)
    logger.info(
        "float8: %d Linear layers train in float8 (torchao, recipe %s%s)",
        count,
        section.recipe,
        ", emulated" if section.emulate else "",
    )
    return count
