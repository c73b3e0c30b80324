"""The decoder layers that ``recompute``, ``recompute_comm`` and ``swap`` name, and how their
submodules are matched.

Layers are named by layer specs (``'0-3'``, ``'5'``); submodules by name patterns (the one rule of
:mod:`lmforge.utils.name_patterns`: exact, part with aliases, glob or regular expression) matched
against the dotted path of every submodule of a decoder layer, relative to the layer, to the decoder
or to the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lmforge.errors import ConfigError
from lmforge.models.common.layers import numbered_layers
from lmforge.utils.name_patterns import NamePattern

# The spec's examples use MindSpore-Transformers graph-mode names ("attention"); lmforge models use
# Megatron names ("self_attention"). A pattern may use either: each path is also offered with these
# components renamed.
_PATH_ALIASES = {"self_attention": "attention"}


@dataclass
class DecoderLayer:
    layer_id: int  # global id: decoder layer i -> i; MTP layer i -> num_layers + i
    name: str  # qualified name in the model, e.g. "decoder.layers.3"
    module: nn.Module


def find_decoder_layers(model: nn.Module, num_layers: int | None = None) -> list[DecoderLayer]:
    """The layers recompute and swap name, by global layer id (the model's
    :func:`~lmforge.models.common.layers.numbered_layers`).

    An MTP depth counts as its transformer layer: recompute and swap act on that, not on the depth's
    projection and norms (as when a depth was called piecewise; kept so that the same file saves the
    same activations).
    """
    found = []
    for layer in numbered_layers(model, num_layers):
        inner = getattr(layer.module, "transformer_layer", None) if layer.is_mtp else None
        if isinstance(inner, nn.Module):
            found.append(DecoderLayer(layer.layer_id, f"{layer.name}.transformer_layer", inner))
        else:
            found.append(DecoderLayer(layer.layer_id, layer.name, layer.module))
    return found


def layer_module_paths(layer: DecoderLayer) -> list[str]:
    """Dotted paths of every submodule of a decoder layer, relative to the layer."""
    return [path for path, _ in layer.module.named_modules() if path]


def _path_forms(layer: DecoderLayer, rel_path: str) -> list[str]:
    """The strings a pattern is matched against for one submodule.

    The path relative to the layer (``self_attention.linear_qkv``), relative to the decoder
    (``layers.3.self_attention.linear_qkv``, the form of the original's DeepSeek-V4 example) and
    the full model path, each also with the graph-mode aliases of :data:`_PATH_ALIASES`.
    """
    container_key = "layers." + layer.name.rsplit("layers.", 1)[-1]  # "layers.3"
    forms = [rel_path, f"{container_key}.{rel_path}", f"{layer.name}.{rel_path}"]
    aliased = []
    for form in forms:
        parts = [_PATH_ALIASES.get(p, p) for p in form.split(".")]
        alias = ".".join(parts)
        if alias != form:
            aliased.append(alias)
    return forms + aliased


def _compile_pattern(pattern: Any, label: str) -> NamePattern:
    # One rule for every name pattern (lmforge.utils.name_patterns): exact, part (with aliases such as
    # attention.qkv), glob or regular expression.
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{label}: a module pattern must be a non-empty string, got {pattern!r}")
    return NamePattern(pattern)


def _match_modules(
    layer: DecoderLayer, regex: NamePattern, skip_under: set[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """Submodules of ``layer`` whose path matches; a child of a matched module is not listed again."""
    matched: list[tuple[str, nn.Module]] = []
    taken = set(skip_under or ())
    for rel_path, module in layer.module.named_modules():
        if not rel_path:
            continue
        if any(rel_path == t or rel_path.startswith(t + ".") for t in taken):
            continue
        if any(regex.fullmatch(form) for form in _path_forms(layer, rel_path)):
            matched.append((rel_path, module))
            taken.add(rel_path)
    return matched


def _no_match_error(label: str, pattern: str, layers: list[DecoderLayer]) -> ConfigError:
    paths = layer_module_paths(layers[0]) if layers else []
    shown = ", ".join(paths[:60]) + (", ..." if len(paths) > 60 else "")
    return ConfigError(
        f"{label}: the pattern {pattern!r} matches no submodule of the selected decoder layers. A pattern "
        "matches a submodule's dotted path (relative to the layer, e.g. 'self_attention.linear_qkv', to the "
        "decoder, 'layers.0.self_attention', or to the model) when it is the path or a part of it, when its "
        "dotted parts are parts of the path ('attention' = 'self_attention', 'qkv' = 'linear_qkv', 'proj' = "
        "'linear_proj', 'fc1'/'fc2' = 'linear_fc1'/'linear_fc2'), or as a shell glob or a regular expression "
        f"matching the whole path (docs/config.md#name-patterns). Available paths in layer "
        f"{layers[0].layer_id if layers else '?'}: {shown or '(none)'}"
    )


def _layers_of(specs: Any, label: str, num_layers: int) -> list[int]:
    """Layer ids named by a spec list, validated as in the original (§1.4)."""
    from lmforge.config.layer_spec import check_layer_range, parse_layer_specs

    if specs is None:
        raise ConfigError(f"{label} is required here: a list of layer specs such as ['0-3'] or ['0', '5']")
    try:
        ranges = parse_layer_specs(specs, label)
        check_layer_range(ranges, list(specs), num_layers, label)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return [layer for lo, hi in ranges for layer in range(lo, hi + 1)]


def _module_specs(value: Any, label: str) -> list[tuple[str, Any]]:
    """``select_module`` as ``(pattern, specs)`` pairs.

    The original's type is ``dict | list``. A mapping is ``{pattern: [specs]}``; a list may hold such
    mappings or bare pattern strings (meaning every layer).
    """
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [(str(k) if not isinstance(k, str) else k, v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        pairs: list[tuple[str, Any]] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                pairs.append((item, None))
            elif isinstance(item, Mapping):
                pairs.extend(item.items())
            else:
                raise ConfigError(
                    f"{label}[{i}] must be a pattern string or a mapping {{pattern: [layer specs]}}, got {item!r}"
                )
        return pairs
    raise ConfigError(f"{label} must be a mapping {{module pattern: [layer specs]}}, got {value!r}")


def _already_covered(targets: list[DecoderLayer], regex: NamePattern, taken: dict[int, set[str]]) -> bool:
    """A pattern whose matches all sit inside modules another pattern already recomputes is fine."""
    for d in targets:
        for rel_path, _ in d.module.named_modules():
            if rel_path and any(regex.fullmatch(f) for f in _path_forms(d, rel_path)):
                return True
    return False
