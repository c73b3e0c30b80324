"""``build_model`` / ``build_model_config``: the typed model section in, an ``nn.Module`` (or its config) out."""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config import ModelConfig
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.init import draw_seed
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.registry import TypedModel


def typed_model(section: Any) -> TypedModel:
    """The typed form of a validated ``model`` section: what ``load_config`` or
    ``lmforge.config.validate_section("model", mapping)`` made (``section.typed``). Anything else is a
    TypeError: validation happens once, when the section is made, never in a builder."""
    typed = section.typed if isinstance(section, ModelConfig) else None
    if not isinstance(typed, TypedModel):
        raise TypeError(
            f"expected the validated model section (cfg.model of load_config, or "
            f"lmforge.config.validate_section('model', mapping)), got {type(section).__name__}."
        )
    return typed


def build_model_config(section: ModelConfig) -> TransformerConfig:
    """The structure of a validated ``model`` section, without building anything (``lmforge check``).

    The section was validated when it was made: an unknown key, a bad type or value, an unknown
    ``model_type`` / ``architectures`` raised ``ConfigError`` naming ``model.<key>`` then.
    """
    return typed_model(section).config


def build_model(
    section: ModelConfig, device: torch.device | str | None = None, seed: int | None = None
) -> GPTModel:
    """Build the model of a validated ``model`` section (see :func:`typed_model`).

    Parameters are created in ``compute_dtype`` (routers in fp32). On a real device (default: CPU) the
    weights are initialised from ``initializer_range`` and ``seed`` (default: one drawn from torch's
    global RNG before anything else), layout-invariantly: ``model.init_weights(seed)`` after sharding
    gives the same values. With ``device="meta"`` nothing is allocated: shard or place the model, then
    ``model.to_empty(device=...)`` and ``model.init_weights(seed)``.
    """
    typed = typed_model(section)
    return build_from_config(typed.config, typed.model_class, device, seed)


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
