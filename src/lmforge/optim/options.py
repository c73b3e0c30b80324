"""Validation of the ``optimizer`` section: every field, its default and the original's error texts.

The section arrives as a pydantic object or a plain mapping. For Muon, a key the YAML does not set
takes Muon's own default (weight_decay 0.1, eps 1e-7, ...), not the AdamW-oriented defaults of the
section schema: the original passes the schema's ``eps: 1e-8`` and ``weight_decay: 0.01`` into Muon
whenever the YAML omits them, which silently changes the Newton-Schulz eps and the decay. With a
pydantic section we know which keys were set (``model_fields_set``); with a plain mapping every key
present counts as set.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError
from lmforge.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, normalize_ns_schedule
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.optim")

OPTIMIZER_TYPES = ("AdamW", "Muon", "Lion", "LAMB")
COMM_STRATEGIES = ("allgather", "allgather_deredundency")
DEFAULT_ADAMW_INCLUDE = ("*word_embeddings*", "*output_layer*")

# Keys every optimizer type understands (parameter grouping and lmforge extensions).
_COMMON_KEYS = {
    "type",
    "weight_decay",
    "weight_decay_include",
    "weight_decay_exclude",
    "weight_decay_values",
    "lr_scale",
    "accumulate_allreduce_grads_in_fp32",
}
# The original's AdamW accepts these (use_fused/enable_fused_opt pick its kernel; we pick ours).
_ADAM_KERNEL_KEYS = {"use_fused", "enable_fused_opt"}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "AdamW": {
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "amsgrad": False,
        "maximize": False,
        "offload_states": False,
        "moment_dtype": "float32",
    },
    "Muon": {
        "weight_decay": 0.1,
        "matched_adamw_rms": 0.2,
        "momentum": 0.95,
        "eps": 1e-7,
        "nesterov": True,
        "ns_steps": 5,
        "ns_coefficients": DEFAULT_NS_COEFFICIENTS,
        "adamw_betas": (0.95, 0.95),
        "adamw_eps": 1e-8,
        "qk_clip_enabled": True,
        "qk_clip_threshold": 100.0,
        "comm_strategy": "allgather",
        "use_fused_adamw": False,
        "adamw_include": None,
        "ns_dtype": "bfloat16",
        "moment_dtype": "float32",
    },
    # Lion (Chen et al. 2023): sign of an interpolated momentum; decay as in AdamW.
    "Lion": {"betas": (0.9, 0.99), "weight_decay": 0.01, "offload_states": False},
    # LAMB (You et al. 2020): Adam direction with a per-parameter trust ratio.
    "LAMB": {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01, "offload_states": False},
}


@dataclass
class GroupingOptions:
    """How parameters are split into groups (shared by every optimizer type)."""

    weight_decay: float
    weight_decay_include: list[str] = field(default_factory=list)
    weight_decay_exclude: list[str] = field(default_factory=list)
    lr_scale: list[tuple[str, float]] = field(default_factory=list)  # (rule, multiplier), first match wins
    # (rule, weight decay) replacing ``weight_decay`` for the parameters that decay; first match wins
    weight_decay_values: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class AdamWHyper:
    betas: tuple[float, float]
    eps: float
    amsgrad: bool
    maximize: bool
    offload_states: bool
    moment_dtype: str  # "float32" or "bfloat16" (lmforge.optim.moment_dtype)


@dataclass(frozen=True)
class LionHyper:
    betas: tuple[float, float]
    offload_states: bool
    moment_dtype: str = "float32"  # compressed moments are AdamW's and Muon's only


@dataclass(frozen=True)
class LAMBHyper:
    betas: tuple[float, float]
    eps: float
    offload_states: bool
    moment_dtype: str = "float32"


@dataclass(frozen=True)
class MuonHyper:
    matched_adamw_rms: float
    momentum: float
    eps: float
    nesterov: bool
    ns_steps: int
    ns_schedule: tuple[tuple[float, float, float], ...]  # one (a, b, c) per Newton-Schulz step
    adamw_betas: tuple[float, float]
    adamw_eps: float
    qk_clip_enabled: bool
    qk_clip_threshold: float
    comm_strategy: str
    use_fused_adamw: bool
    adamw_include: list[str]
    ns_dtype: str
    moment_dtype: str
    offload_states: bool = False  # refused for Muon when set


Hyper = AdamWHyper | LionHyper | LAMBHyper | MuonHyper
_HYPER_CLASSES: dict[str, type] = {
    "AdamW": AdamWHyper,
    "Lion": LionHyper,
    "LAMB": LAMBHyper,
    "Muon": MuonHyper,
}


@dataclass
class OptimizerOptions:
    """The typed ``optimizer`` section: the grouping every type shares and the hyper-parameters of
    ``type`` (one class per type, so a builder reads attributes, never string keys)."""

    type: str
    grouping: GroupingOptions
    hyper: Hyper
    ignored_keys: list[str] = field(default_factory=list)


def _err(key: str, message: str) -> ConfigError:
    return ConfigError(f"optimizer.{key}: {message}")


def _given_keys(section: Any, data: dict[str, Any]) -> set[str]:
    """Keys the user actually wrote (pydantic knows; for a mapping every present key counts)."""
    fields_set = getattr(section, "model_fields_set", None)
    if fields_set is None:
        return set(data)
    schema = _schema_fields(section)
    # Schema fields count only when set; extras exist only because the user wrote them.
    return {k for k in data if k not in schema or k in fields_set}


def _schema_fields(section: Any) -> set[str]:
    fields = getattr(type(section), "model_fields", None)
    return set(fields) if fields else set()


def _as_float(key: str, value: Any) -> float:
    # The original requires floats (``weight_decay: 0`` fails there); an int is a number, so we take it.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _err(key, f"expected a number, got {type(value).__name__} ({value!r}).")
    value = float(value)
    if not math.isfinite(value):
        raise _err(key, f"expected a finite number, got {value!r}.")
    return value


def _as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _err(key, f"expected true or false, got {type(value).__name__} ({value!r}).")
    return value


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(key, f"expected an integer, got {type(value).__name__} ({value!r}).")
    return value


def _betas(key: str, value: Any) -> tuple[float, float]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != 2:
        raise _err(key, f"expected a list of 2 numbers [beta1, beta2], got {value!r}.")
    b = tuple(_as_float(f"{key}[{i}]", v) for i, v in enumerate(value))
    for i, v in enumerate(b):
        if not 0.0 <= v < 1.0:
            raise _err(key, f"Invalid beta parameter at index {i}: {v}, should be >= 0 and < 1.")
    return b  # type: ignore[return-value]


def _eps(key: str, value: Any) -> float:
    v = _as_float(key, value)
    if v < 0:
        raise _err(key, f"Invalid epsilon value: {v}, should be >= 0.")
    return v


def _weight_decay(value: Any) -> float:
    v = _as_float("weight_decay", value)
    if v < 0:
        raise _err("weight_decay", f"Invalid weight_decay value: {v}, should be >= 0.")
    return v


def _rule_list(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise _err(key, f"{key} should be a list of strings, but got {type(value).__name__}.")
    for item in value:
        if not isinstance(item, str):
            raise _err(key, f"All items in {key} should be strings, but got {type(item).__name__}.")
    return list(value)


def _lr_scale(value: Any) -> list[tuple[str, float]]:
    """``lr_scale: {"*word_embeddings*": 0.5, ...}``: per-name-pattern lr multipliers."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise _err(
            "lr_scale",
            "expected a mapping from parameter-name rule (exact name, substring or glob) to a "
            f'positive lr multiplier, e.g. {{"*word_embeddings*": 0.5}}; got {type(value).__name__}.',
        )
    rules = []
    for rule, scale in value.items():
        if not isinstance(rule, str):
            raise _err("lr_scale", f"rule {rule!r} must be a string.")
        s = _as_float(f"lr_scale.{rule}", scale)
        if s <= 0:
            raise _err(f"lr_scale.{rule}", f"the lr multiplier must be > 0, got {s}.")
        rules.append((rule, s))
    return rules


def _weight_decay_values(value: Any) -> list[tuple[str, float]]:
    """``weight_decay_values: {"*word_embeddings*": 0.02, ...}``: per-name-pattern decay values."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise _err(
            "weight_decay_values",
            "expected a mapping from parameter-name rule (exact name, substring or glob) to a weight "
            f'decay >= 0, e.g. {{"*word_embeddings*": 0.02, "decoder.layers": 0.01}}; got {type(value).__name__}.',
        )
    rules = []
    for rule, wd in value.items():
        if not isinstance(rule, str):
            raise _err("weight_decay_values", f"rule {rule!r} must be a string.")
        v = _as_float(f"weight_decay_values.{rule}", wd)
        if v < 0:
            raise _err(f"weight_decay_values.{rule}", f"Invalid weight_decay value: {v}, should be >= 0.")
        rules.append((rule, v))
    return rules


def _adamw_include(value: Any) -> list[str]:
    if value is None:
        return list(DEFAULT_ADAMW_INCLUDE)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _err("adamw_include", "adamw_include must be a list of glob strings.")
    return list(value)


def _ns_dtype(value: Any) -> str:
    if value not in ("bfloat16", "float32"):
        raise _err("ns_dtype", f"expected 'bfloat16' or 'float32', got {value!r}.")
    return value


def _moment_dtype(value: Any) -> str:
    if value not in ("float32", "bfloat16"):
        raise _err(
            "moment_dtype",
            f"expected 'float32' (default) or 'bfloat16' (moments stored in bf16, updated in fp32 with "
            f"stochastic rounding), got {value!r}.",
        )
    return value


def _validate_adamw_like(kind: str, raw: dict[str, Any], hyper: dict[str, Any]) -> None:
    hyper["betas"] = _betas("betas", raw["betas"])
    if "eps" in hyper:
        hyper["eps"] = _eps("eps", raw["eps"])
    if kind == "AdamW":
        hyper["amsgrad"] = _as_bool("amsgrad", raw["amsgrad"])
        hyper["maximize"] = _as_bool("maximize", raw["maximize"])
    hyper["offload_states"] = _as_bool("offload_states", raw["offload_states"])
    if kind == "AdamW":
        hyper["moment_dtype"] = _moment_dtype(raw["moment_dtype"])


def _validate_muon(raw: dict[str, Any], hyper: dict[str, Any]) -> None:
    if raw.get("swap"):
        raise _err("swap", "Muon does not support swap.")
    hyper["momentum"] = _as_float("momentum", raw["momentum"])
    if not 0.0 <= hyper["momentum"] < 1.0:
        raise _err("momentum", f"must be >= 0 and < 1, got {hyper['momentum']}.")
    hyper["matched_adamw_rms"] = _as_float("matched_adamw_rms", raw["matched_adamw_rms"])
    if hyper["matched_adamw_rms"] <= 0:
        raise _err("matched_adamw_rms", f"must be > 0, got {hyper['matched_adamw_rms']}.")
    hyper["eps"] = _eps("eps", raw["eps"])
    hyper["nesterov"] = _as_bool("nesterov", raw["nesterov"])
    ns_steps = raw["ns_steps"]
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise _err("ns_steps", f"expected an integer, got {type(ns_steps).__name__} ({ns_steps!r}).")
    try:
        schedule, steps = normalize_ns_schedule(raw["ns_coefficients"], ns_steps)
    except ValueError as exc:
        key = "ns_steps" if str(exc).startswith("ns_steps") else "ns_coefficients"
        raise _err(key, str(exc)) from None
    hyper["ns_schedule"] = schedule
    hyper["ns_steps"] = steps
    hyper["adamw_betas"] = _betas("adamw_betas", raw["adamw_betas"])
    hyper["adamw_eps"] = _eps("adamw_eps", raw["adamw_eps"])
    hyper["qk_clip_enabled"] = _as_bool("qk_clip_enabled", raw["qk_clip_enabled"])
    hyper["qk_clip_threshold"] = _as_float("qk_clip_threshold", raw["qk_clip_threshold"])
    if hyper["qk_clip_enabled"] and hyper["qk_clip_threshold"] <= 0:
        raise _err(
            "qk_clip_threshold", f"qk_clip_threshold must be positive, got {hyper['qk_clip_threshold']}."
        )
    cs = raw["comm_strategy"]
    if cs not in COMM_STRATEGIES:
        raise _err(
            "comm_strategy", f"comm_strategy must be 'allgather' or 'allgather_deredundency', got {cs!r}."
        )
    hyper["comm_strategy"] = cs
    hyper["use_fused_adamw"] = _as_bool("use_fused_adamw", raw["use_fused_adamw"])
    hyper["adamw_include"] = _adamw_include(raw["adamw_include"])
    hyper["ns_dtype"] = _ns_dtype(raw["ns_dtype"])
    hyper["moment_dtype"] = _moment_dtype(raw["moment_dtype"])


def parse_optimizer_section(section: Any) -> OptimizerOptions:
    """Validate the ``optimizer`` section and fill defaults; raises :class:`ConfigError`."""
    # This is the optimizer's schema (load_config runs it on the typed section): it reads the plain values.
    data = copy.deepcopy(section.to_dict() if hasattr(section, "to_dict") else dict(section or {}))
    given = _given_keys(section, data)
    kind = data.get("type", "AdamW")
    if kind not in OPTIMIZER_TYPES:
        raise _err(
            "type",
            f"Optimizer type {kind} is not implemented yet. Valid types: {', '.join(OPTIMIZER_TYPES)}.",
        )
    defaults = _DEFAULTS[kind]
    raw = dict(defaults)
    raw.update({k: v for k, v in data.items() if k in given})

    # ``enable_cpu_offload`` is the original AdamW's spelling (rejected there); lmforge implements it.
    if "enable_cpu_offload" in given and kind != "Muon":
        raw["offload_states"] = raw.pop("enable_cpu_offload")
    hyper: dict[str, Any] = {k: raw[k] for k in defaults if k not in ("weight_decay",)}  # checked below
    if kind == "Muon":
        for key in ("offload_states", "enable_cpu_offload"):
            if raw.get(key):
                raise _err(key, "state offload is implemented for AdamW, Lion and LAMB, not Muon.")
        _validate_muon(raw, hyper)
    else:
        _validate_adamw_like(kind, raw, hyper)
        if kind != "AdamW" and "moment_dtype" in given and raw["moment_dtype"] != "float32":
            raise _err(
                "moment_dtype",
                f"compressed (bf16) moments are implemented for AdamW and Muon, not {kind}; remove the key "
                "or use type: AdamW / Muon.",
            )

    grouping = GroupingOptions(
        weight_decay=_weight_decay(raw["weight_decay"]),
        weight_decay_include=_rule_list("weight_decay_include", raw.get("weight_decay_include")),
        weight_decay_exclude=_rule_list("weight_decay_exclude", raw.get("weight_decay_exclude")),
        lr_scale=_lr_scale(raw.get("lr_scale")),
        weight_decay_values=_weight_decay_values(raw.get("weight_decay_values")),
    )

    if "accumulate_allreduce_grads_in_fp32" in given and raw["accumulate_allreduce_grads_in_fp32"] is False:
        logger.warning(
            "optimizer.accumulate_allreduce_grads_in_fp32: false has no effect; gradients of bf16/fp16 "
            "parameters always accumulate and reduce in fp32 (as in the original since it removed the switch)."
        )
    known = _COMMON_KEYS | set(defaults) | {"enable_cpu_offload", "swap", "moment_dtype"}
    if kind == "AdamW":
        known |= _ADAM_KERNEL_KEYS
    # Kernel choices of the original: lmforge always steps its masters with torch's fused AdamW kernel.
    for key in sorted((_ADAM_KERNEL_KEYS if kind == "AdamW" else {"use_fused_adamw"}) & set(given)):
        logger.warning(
            "optimizer.%s = %r has no effect: lmforge picks its own kernel (torch's fused AdamW on the "
            "fp32 masters).",
            key,
            raw[key],
        )
    ignored = sorted(k for k in given if k not in known)
    for key in ignored:
        hint = (
            " (Muon's AdamW branch uses adamw_betas / adamw_eps)" if kind == "Muon" and key == "betas" else ""
        )
        logger.warning("optimizer.%s is not used by the %s optimizer and has no effect%s.", key, kind, hint)
    return OptimizerOptions(
        type=kind, grouping=grouping, hyper=_typed_hyper(kind, hyper), ignored_keys=ignored
    )


def _typed_hyper(kind: str, checked: dict[str, Any]) -> Hyper:
    # Every value was checked above; Muon's coefficients became ``ns_schedule``.
    cls = _HYPER_CLASSES[kind]
    names = cls.__dataclass_fields__
    return cls(**{k: v for k, v in checked.items() if k in names})
