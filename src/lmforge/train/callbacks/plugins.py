"""User callbacks from outside lmforge: an import path in the YAML, or a package's entry point.

A ``callbacks:`` item's ``type`` is looked up in this order:

1. the registry (``@register_callback`` — lmforge's own, and any a user module registered);
2. an entry point of the group ``lmforge.callbacks`` with that name, declared by an installed
   package (``[project.entry-points."lmforge.callbacks"] MyCallback = "my_pkg.cb:MyCallback"``);
3. an import path, ``package.module:ClassName`` (or ``package.module.ClassName``): the module is
   imported (it must be importable, e.g. on ``PYTHONPATH``) and the class used — only when the person
   running the command opts in (``--allow-imports`` or ``LMFORGE_ALLOW_IMPORTS=1``): a YAML file
   is data, and importing a module it names runs that module's code (also a stray ``*.py`` in the
   working directory). Installed entry points need no opt-in: installing the package was the opt-in.

The class is called with the item's other keys as keyword arguments. It should subclass
``lmforge.train.callbacks.TrainerCallback``; any class with at least one hook method works.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from typing import Any

from lmforge.errors import ConfigError
from lmforge.train.callbacks.base import HOOKS

ENTRY_POINT_GROUP = "lmforge.callbacks"
# The opt-in for importing modules named in a YAML (the CLI's --allow-imports sets it, so that
# processes started by torchrun inherit it).
ALLOW_IMPORTS_ENV = "LMFORGE_ALLOW_IMPORTS"


def imports_allowed() -> bool:
    return os.environ.get(ALLOW_IMPORTS_ENV, "").strip().lower() in ("1", "true", "yes")


# lmforge's registered callbacks that live outside the trainer's own modules.
BUILTIN_MODULES = ("lmforge.train.callbacks.max_logits", "lmforge.train.callbacks.downstream")


def load_builtin_callbacks() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def _check(cls: Any, name: str, index: int) -> type:
    if not isinstance(cls, type) or not any(callable(getattr(cls, hook, None)) for hook in HOOKS):
        raise ConfigError(
            f"callbacks[{index}].type: {name!r} is not a callback class (it has none of the hooks "
            f"{', '.join(HOOKS)}); subclass lmforge.train.callbacks.TrainerCallback"
        )
    return cls


def _from_import_path(name: str, index: int) -> type | None:
    if ":" in name:
        module_name, _, attr = name.partition(":")
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
    else:
        return None
    if not imports_allowed():
        raise ConfigError(
            f"callbacks[{index}].type: {name!r} names Python code to import ({module_name!r}), and importing "
            f"it would run that code. lmforge imports modules named in a YAML only when the person running "
            f"the command allows it: add --allow-imports (e.g. `lmforge --allow-imports train ...`) or set "
            f"{ALLOW_IMPORTS_ENV}=1 if you trust this file. Callbacks of installed packages (entry points of "
            f"the group {ENTRY_POINT_GROUP!r}) and lmforge's own need no opt-in."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"callbacks[{index}].type: cannot import {module_name!r} for callback {name!r} ({exc}); the "
            "module must be importable (installed, or on PYTHONPATH)"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"callbacks[{index}].type: module {module_name!r} has no attribute {attr!r}")
    return _check(cls, name, index)


def _from_entry_point(name: str, index: int) -> type | None:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return _check(ep.load(), name, index)
    return None


def resolve_callback(name: Any, index: int) -> type | None:
    """The class an unregistered ``type`` names, or None (the caller reports the unknown type)."""
    if not isinstance(name, str) or not name:
        return None
    return _from_entry_point(name, index) or _from_import_path(name, index)
