"""``build_model`` / ``build_model_config``: the model section in, an ``nn.Module`` (or its config) out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.init import draw_seed
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.registry import resolve


def typed_model(section: Any) -> tuple[TransformerConfig, type[GPTModel]]:
    """The structure and model class of a ``model`` section: what ``load_config`` typed
    (``section.typed``), or a plain mapping resolved by the same family schema."""
    typed = getattr(section, "typed", None)
    if typed is not None:
        return typed.config, typed.model_class
    if isinstance(section, Mapping):
        return resolve(dict(section))
    return resolve(section.to_dict())  # a ModelConfig validated without the registered schemas


def build_model_config(section: Any) -> TransformerConfig:
    """Validate the ``model`` section without building anything (``lmforge check``).

    Raises ``ConfigError`` naming ``model.<key>`` for an unknown key (with the valid keys), a bad type or
    value, or an unknown ``model_type`` / ``architectures``.
    """
    return typed_model(section)[0]


def build_model(section: Any, device: torch.device | str | None = None, seed: int | None = None) -> GPTModel:
    """Build the model of a ``model`` section.

    Parameters are created in ``compute_dtype`` (routers in fp32). On a real device (default: CPU) the
    weights are initialised from ``initializer_range`` and ``seed`` (default: one drawn from torch's
    global RNG before anything else), layout-invariantly: ``model.init_weights(seed)`` after sharding
    gives the same values. With ``device="meta"`` nothing is allocated: shard or place the model, then
    ``model.to_empty(device=...)`` and ``model.init_weights(seed)``.
    """
    cfg, cls = typed_model(section)
    return build_from_config(cfg, cls, device, seed)


def build_from_config(
    cfg: TransformerConfig,
    cls: type[GPTModel],
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> GPTModel:
    device = torch.device(device) if device is not None else torch.device("cpu")
    # Drawn before construction: building on a real device runs torch's default module initialisers,
    # which consume the global RNG, while a meta build does not.
    seed = draw_seed() if seed is None and device.type != "meta" else seed
    with torch.device(device):
        model = cls(cfg)
    if device.type != "meta":
        model.init_weights(seed)
    return model.cast_to_compute_dtype()
