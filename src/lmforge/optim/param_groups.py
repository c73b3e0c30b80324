"""Parameter groups shared by every optimizer: weight decay, lr multipliers, routing, tied weights.

Weight-decay priority (the original's ``get_param_groups``): ``weight_decay_include`` forces decay,
then ``weight_decay_exclude`` forces none, then the defaults give none to 1-D parameters, names
ending in ``.bias`` and the model's declared no-decay names. A parameter that decays takes its value
from the first ``weight_decay_values`` rule that matches it, else ``weight_decay`` (so a broad rule
like ``decoder.layers`` never puts decay on norms or biases). Rules match by exact name, substring or
glob. A parameter reachable under several names (tied embeddings) is one parameter: it gets one
group and one optimizer state, and a rule matching any of its names applies to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.errors import ConfigError
from lmforge.optim.specs import GroupingOptions
from lmforge.utils.logging import get_logger
from lmforge.utils.name_patterns import first_match

logger = get_logger("lmforge.optim")


@dataclass
class ParamInfo:
    param: nn.Parameter
    names: list[str]  # every name of this tensor in the model; names[0] is the canonical one
    weight_decay: float
    wd_reason: str
    lr_scale: float
    route: str  # "default", or for Muon: "muon" / "adamw"


def trainable_parameters(model: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    """Each trainable parameter once, with all its names (aliases of tied weights)."""
    seen: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) in seen:
            seen[id(p)][1].append(name)
        else:
            seen[id(p)] = (p, [name])
    return list(seen.values())


def model_no_decay_names(model: nn.Module) -> tuple[set[str], list[str]]:
    """(exact names, substring keywords) that the model declares free of weight decay."""
    names: set[str] = set()
    keywords: list[str] = []
    for attr in ("no_weight_decay_names", "no_weight_decay"):
        fn = getattr(model, attr, None)
        if callable(fn):
            names |= set(fn())
    fn = getattr(model, "no_weight_decay_keywords", None)
    if callable(fn):
        keywords = list(fn())
    return names, keywords


def _decay_decision(
    p: torch.Tensor, names: list[str], opts: GroupingOptions, no_decay: set[str], keywords: list[str]
) -> tuple[float, str]:
    rule = first_match(names, opts.weight_decay_include)
    if rule is not None:
        return opts.weight_decay, f"custom_include:{rule}"
    rule = first_match(names, opts.weight_decay_exclude)
    if rule is not None:
        return 0.0, f"custom_exclude:{rule}"
    if p.dim() == 1:
        return 0.0, "1d_param"
    if any(n.endswith(".bias") for n in names):
        return 0.0, "bias"
    if any(n in no_decay for n in names):
        return 0.0, "model_no_weight_decay"
    if any(k in n for k in keywords for n in names):
        return 0.0, "model_no_weight_decay_keywords"
    return opts.weight_decay, "default"


def _decay_value(names: list[str], opts: GroupingOptions, wd: float, reason: str) -> tuple[float, str]:
    """The per-pattern value of a decaying parameter (``weight_decay_values``), else ``wd``."""
    decays = reason == "default" or reason.startswith("custom_include:")
    if not decays:
        return wd, reason
    rule = first_match(names, [r for r, _ in opts.weight_decay_values])
    if rule is None:
        return wd, reason
    return dict(opts.weight_decay_values)[rule], f"{reason}+value:{rule}"


def classify_parameters(
    model: nn.Module, opts: GroupingOptions, route: Callable[[torch.Tensor, list[str]], str] | None = None
) -> list[ParamInfo]:
    no_decay, keywords = model_no_decay_names(model)
    infos = []
    for p, names in trainable_parameters(model):
        wd, reason = _decay_value(names, opts, *_decay_decision(p, names, opts, no_decay, keywords))
        lr_rule = first_match(names, [r for r, _ in opts.lr_scale])
        lr_scale = dict(opts.lr_scale)[lr_rule] if lr_rule is not None else 1.0
        infos.append(ParamInfo(p, names, wd, reason, lr_scale, route(p, names) if route else "default"))
        logger.debug(
            "param_name: %-60s | weight_decay: %8.4f | reason: %s | lr_scale: %s%s",
            names[0],
            wd,
            reason,
            lr_scale,
            f" | tied with: {', '.join(names[1:])}" if len(names) > 1 else "",
        )
    return infos


def build_param_groups(
    model: nn.Module, opts: GroupingOptions, route: Callable[[torch.Tensor, list[str]], str] | None = None
) -> list[dict]:
    """torch-style param groups keyed by (route, weight decay, lr scale), in first-seen order.

    Each group carries ``params``, ``param_names`` (canonical names), ``weight_decay``, ``lr_scale``,
    ``route`` and a readable ``name``; ``lr`` is set by the optimizer.
    """
    infos = classify_parameters(model, opts, route)
    groups: dict[tuple[str, float, float], dict] = {}
    for info in infos:
        key = (info.route, info.weight_decay, info.lr_scale)
        if key not in groups:
            parts = [] if info.route == "default" else [info.route]
            parts.append("decay" if info.weight_decay > 0 else "no_decay")
            if info.weight_decay > 0 and info.weight_decay != opts.weight_decay:
                parts[-1] += f"_{info.weight_decay:g}"
            if info.lr_scale != 1.0:
                parts.append(f"lr_x{info.lr_scale:g}")
            groups[key] = {
                "name": "/".join(parts),
                "route": info.route,
                "weight_decay": info.weight_decay,
                "lr_scale": info.lr_scale,
                "params": [],
                "param_names": [],
            }
        groups[key]["params"].append(info.param)
        groups[key]["param_names"].append(info.names[0])
    result = list(groups.values())
    log_group_summary(result)
    tied = [i.names for i in infos if len(i.names) > 1]
    for names in tied:
        logger.info("tied parameter %s (also %s): one optimizer state", names[0], ", ".join(names[1:]))
    return result


def log_group_summary(groups: list[dict]) -> None:
    header = f"{'group':<24} {'count':>6} {'parameters':>14} {'weight decay':>13} {'lr scale':>9}"
    lines = ["optimizer parameter groups:", header, "-" * len(header)]
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        lines.append(
            f"{g['name']:<24} {len(g['params']):>6} {n:>14,} {g['weight_decay']:>13g} {g['lr_scale']:>9g}"
        )
    logger.info("\n".join(lines))


def check_group_coverage(groups: list[dict], model: nn.Module | None) -> None:
    """Each parameter in at most one group; with a model, every trainable parameter in some group."""
    where: dict[int, int] = {}
    names_of: dict[int, str] = {}
    if model is not None:
        for p, names in trainable_parameters(model):
            names_of[id(p)] = names[0] if len(names) == 1 else f"{names[0]} (tied: {', '.join(names[1:])})"
    for gi, g in enumerate(groups):
        for j, p in enumerate(g["params"]):
            label = names_of.get(id(p)) or (g.get("param_names") or [None] * (j + 1))[j] or f"#{j}"
            if id(p) in where:
                raise ConfigError(
                    f"optimizer: parameter {label} appears in group {where[id(p)]} and group {gi}; a parameter "
                    "(including a tied embedding reachable under two names) must belong to exactly one group, "
                    "otherwise it gets two optimizer states and its updates overwrite each other."
                )
            where[id(p)] = gi
    missing = [label for pid, label in names_of.items() if pid not in where]
    if missing:
        raise ConfigError(
            f"optimizer: trainable parameter(s) {', '.join(missing)} are in no parameter group and would never be "
            "updated; add them to a group or set requires_grad=False."
        )
