"""``build_model`` / ``build_model_config``: the model section in, an ``nn.Module`` (or its config) out."""

from __future__ import annotations

from typing import Any

import torch

from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.registry import resolve
from lmforge.utils.sections import section_to_dict


def build_model_config(section: Any) -> TransformerConfig:
    """Validate the ``model`` section without building anything (``lmforge check``).

    Raises ``ConfigError`` naming ``model.<key>`` for an unknown key (with the valid keys), a bad type or
    value, or an unknown ``model_type`` / ``architectures``.
    """
    cfg, _ = resolve(section_to_dict(section))
    return cfg


def build_model(section: Any, device: torch.device | str | None = None) -> GPTModel:
    """Build the model of a ``model`` section.

    Parameters are created in ``compute_dtype`` (routers in fp32). On a real device (default: CPU) the
    weights are initialised from ``initializer_range`` with torch's global RNG. With ``device="meta"``
    nothing is allocated: shard or place the model, then ``model.to_empty(device=...)`` and
    ``model.init_weights()``.
    """
    cfg, cls = resolve(section_to_dict(section))
    return build_from_config(cfg, cls, device)


def build_from_config(
    cfg: TransformerConfig, cls: type[GPTModel], device: torch.device | str | None = None
) -> GPTModel:
    device = torch.device(device) if device is not None else torch.device("cpu")
    with torch.device(device):
        model = cls(cfg)
    if device.type != "meta":
        model.init_weights()
    return model.cast_to_compute_dtype()
