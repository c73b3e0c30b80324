"""LoRA adapters (``lora_config``), applied from outside the model.

``apply_lora(model, section)`` replaces each selected ``nn.Linear`` by a :class:`LoRALinear` that keeps
the same ``weight`` / ``bias`` parameters (so every base name, e.g.
``decoder.layers.0.self_attention.linear_qkv.weight``, is unchanged: Hugging Face loading, weight-decay
patterns and checkpoints keep working) and adds two visible child modules ``lora_A`` ``[r, in]`` and
``lora_B`` ``[out, r]``. Every parameter that is not an adapter is frozen (``requires_grad=False``): it
gets no gradient and the optimizer, which only takes trainable parameters, keeps no state for it.

    y = x W^T + b + (lora_alpha / lora_rank) * dropout(x) A^T B^T

Selection (the original's ``LoraConfig``): a ``nn.Linear`` whose full dotted module name
``re.match``-es ``target_modules`` (anchored at the start, as Python's ``re.match``: write ``.*linear_qkv``
to match anywhere) and does not ``re.match`` ``exclude_layers`` gets an adapter.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.sections_run import LoraConfig
from lmforge.errors import ConfigError

LORA_PARAM_PARTS = (".lora_A.", ".lora_B.")


def is_lora_param_name(name: str) -> bool:
    """True for the parameter names of adapters (``...linear_qkv.lora_A.weight``)."""
    return any(part in f".{name}" for part in LORA_PARAM_PARTS)


class LoRAProjection(nn.Module):
    """One low-rank factor: a bias-free projection with a ``weight`` (a plain module, not an
    ``nn.Linear``, so the model's own ``init_weights`` leaves it to :func:`init_lora_weights`)."""

    def __init__(self, in_features: int, out_features: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight`` / ``bias``) plus a low-rank update ``scaling * B(A(dropout(x))))``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = LoRAProjection(base.in_features, rank, **kw)
        self.lora_B = LoRAProjection(rank, base.out_features, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` in fp32 (the update the adapter adds to ``weight``)."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, lora_alpha={self.alpha:g}"


def _settings(section: LoraConfig) -> dict[str, Any]:
    s = section  # typed by load_config (or lmforge.config.validate_section("lora_config", mapping))
    return {
        "target_modules": s.target_modules or "",
        "exclude_layers": s.exclude_layers or None,
        "lora_rank": int(s.lora_rank),
        "lora_alpha": float(s.lora_alpha),
        "lora_dropout": float(s.lora_dropout),
        "lora_a_std": float(s.lora_a_std),
        "lora_b_std": float(s.lora_b_std),
    }


def select_lora_targets(model: nn.Module, section: LoraConfig) -> list[str]:
    """Names of the ``nn.Linear`` modules that ``section`` puts adapters on (ConfigError if none)."""
    s = _settings(section)
    linears = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)
    ]
    examples = ", ".join(linears[:6]) + (", ..." if len(linears) > 6 else "")
    if not s["target_modules"]:
        raise ConfigError(
            "lora_config.target_modules is empty: it must be a regular expression matched (re.match, from the "
            f"start) against module names, e.g. '.*linear_qkv|.*linear_proj'. This model's linear modules: {examples}."
        )
    target = re.compile(s["target_modules"])
    exclude = re.compile(s["exclude_layers"]) if s["exclude_layers"] else None
    chosen = [n for n in linears if target.match(n) and not (exclude and exclude.match(n))]
    if not chosen:
        raise ConfigError(
            f"lora_config.target_modules {s['target_modules']!r} (exclude_layers {s['exclude_layers']!r}) matches "
            "no linear module (re.match against the full dotted name, anchored at the start: write '.*linear_qkv' "
            f"to match anywhere). This model's linear modules: {examples}."
        )
    return chosen


def apply_lora(model: nn.Module, section: LoraConfig) -> list[str]:
    """Put adapters on the selected modules and freeze everything else. Returns the adapted names.

    Call it before ``parallelize`` (FSDP2 then shards adapters and frozen weights alike) and follow
    it with :func:`init_lora_weights` once the parameters are materialised.
    """
    s = _settings(section)
    names = select_lora_targets(model, section)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        adapted = LoRALinear(getattr(parent, child), s["lora_rank"], s["lora_alpha"], s["lora_dropout"])
        setattr(parent, child, adapted)
    for m in lora_modules(model).values():
        for p in (m.lora_A.weight, m.lora_B.weight):
            p.requires_grad_(True)
    model.lora_settings = s  # read by init_lora_weights and the exporters
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted modules by their dotted name (wrapper prefixes of recompute / compile removed)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            for part in ("_checkpoint_wrapped_module.", "_orig_mod."):
                name = name.replace(part, "")
            out[name] = m
    return out


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> None:
    """A ~ N(0, lora_a_std²), B ~ N(0, lora_b_std²) (0 by default, so training starts at the base model).

    Drawn as full tensors from a generator seeded with ``seed``, in module-name order, then sharded as
    the parameter is: the same seed gives the same adapters on every parallel layout.
    """
    s = getattr(model, "lora_settings", None)
    if s is None:
        return
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    for _, m in sorted(lora_modules(model).items()):
        for param, std in ((m.lora_A.weight, s["lora_a_std"]), (m.lora_B.weight, s["lora_b_std"])):
            full = torch.randn(tuple(param.shape), generator=gen, dtype=torch.float32) * std
            if std == 0.0:
                full.zero_()
            _copy_full(param, full)


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        dt = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements)
        param.to_local().copy_(dt.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W + scaling * B A``, in fp32) and put plain
    ``nn.Linear`` modules back: the result has the base model's structure and names. In place."""
    for name, m in lora_modules(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        merged = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        merged.weight = nn.Parameter((m.weight.float() + m.delta_weight()).to(m.weight.dtype))
        if m.bias is not None:
            merged.bias = nn.Parameter(m.bias.detach().clone())
        setattr(parent, child, merged)
    if hasattr(model, "lora_settings"):
        del model.lora_settings
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def lora_summary(model: nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    n = len(lora_modules(model))
    pct = 100.0 * trainable / total if total else math.nan
    return f"LoRA on {n} module(s): {trainable:,} trainable of {total:,} parameters ({pct:.2f}%)"
