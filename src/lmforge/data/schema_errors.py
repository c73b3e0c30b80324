"""One ``ConfigError`` from a data schema's pydantic ``ValidationError``: every problem named by its dotted
key, each once (the Megatron loader, its GPTDataset config and the text loader share this wording)."""

from __future__ import annotations

from pydantic import ValidationError

from lmforge.errors import ConfigError


def config_error(exc: ValidationError, path: str) -> ConfigError:
    """The problems of ``exc`` under ``path``: a field's own ``ConfigError`` as it is (it names its key),
    anything else as ``<path>.<key>: <pydantic's message>, got <value>``; several are numbered."""
    messages: list[str] = []
    for err in exc.errors():
        problem = err.get("ctx", {}).get("error")
        if isinstance(problem, ConfigError):
            messages.append(str(problem))
        else:  # a field checks its own type first; this is a plugin's or a nested model's value
            key = ".".join([path, *map(str, err["loc"])])
            messages.append(f"{key}: {err['msg']}, got {err.get('input')!r}.")
    messages = list(dict.fromkeys(messages))
    if len(messages) == 1:
        return ConfigError(messages[0])
    numbered = " ".join(f"({i}) {m}" for i, m in enumerate(messages, 1))
    return ConfigError(f"{path} has {len(messages)} problems: {numbered}")
