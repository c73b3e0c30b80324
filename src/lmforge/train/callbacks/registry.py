"""Callbacks by name, for the ``callbacks:`` list of the YAML (``type`` picks the class; the
other keys are its keyword arguments)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmforge.config.sections_run import CallbackConfig
from lmforge.errors import ConfigError
from lmforge.train.callbacks.base import TrainerCallback

_REGISTRY: dict[str, type[TrainerCallback]] = {}


def register_callback(name: str | None = None) -> Callable[[type[TrainerCallback]], type[TrainerCallback]]:
    def deco(cls: type[TrainerCallback]) -> type[TrainerCallback]:
        _REGISTRY[name or cls.__name__] = cls
        return cls

    return deco


def registered_callbacks() -> dict[str, type[TrainerCallback]]:
    return dict(_REGISTRY)


def callback_class(name: Any, index: int) -> type[TrainerCallback]:
    """The class ``callbacks[index].type`` names (registered, built-in, import path or entry point)."""
    if name not in _REGISTRY:
        # lmforge's other built-ins, then an import path or an entry point (see plugins.py).
        from lmforge.train.callbacks.plugins import load_builtin_callbacks, resolve_callback

        load_builtin_callbacks()
        found = None if name in _REGISTRY else resolve_callback(name, index)
        if found is not None:
            _REGISTRY[name] = found
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ConfigError(
            f"callbacks[{index}].type: unknown callback {name!r}; registered callbacks: {known}."
        )
    return _REGISTRY[name]


def check_callback(item: CallbackConfig, index: int) -> None:
    """Refuse ``callbacks[index]`` (typed) the way :func:`build_callback` would, without constructing it."""
    import inspect

    name, kwargs = item.type, item.extras()
    cls = callback_class(name, index)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"callbacks[{index}] ({name}): invalid arguments {sorted(kwargs)}: {exc}") from None
    except ValueError:
        pass  # no introspectable signature: the constructor decides


def build_callback(item: CallbackConfig, index: int) -> TrainerCallback:
    """Build ``callbacks[index]`` of the config (the typed item: ``type`` and the callback's arguments)."""
    name, kwargs = item.type, item.extras()
    cls = callback_class(name, index)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"callbacks[{index}] ({name}): invalid arguments {sorted(kwargs)}: {exc}") from None
