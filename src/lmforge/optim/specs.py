"""The typed ``optimizer`` section: one pydantic schema per optimizer ``type``.

Each schema lists the keys its optimizer takes, typed and range-checked by
:mod:`lmforge.optim.fields`, with that optimizer's own defaults: a Muon section that omits ``eps``
gets Muon's 1e-7, not the AdamW-oriented 1e-8 the original passes into Muon whenever the YAML omits
it (which silently changes the Newton-Schulz eps and the decay). A key no schema of the type lists
is kept (``extra="allow"``) and warned about by :mod:`lmforge.optim.schema`, as the original
ignores it. The builder reads :class:`OptimizerOptions`: the grouping every type shares and the
validated schema of ``type`` as ``hyper`` (attributes, never string keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from lmforge.optim.fields import (
    DEFAULT_ADAMW_INCLUDE,
    AdamwInclude,
    Betas,
    Bool,
    CommStrategy,
    Eps,
    ExcludeRules,
    IncludeRules,
    Int,
    KeyProblem,
    LrScale,
    MomentDtype,
    NsDtype,
    Number,
    WeightDecay,
    WeightDecayValues,
)
from lmforge.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, Schedule, normalize_ns_schedule


@dataclass
class GroupingOptions:
    """How parameters are split into groups (shared by every optimizer type)."""

    weight_decay: float
    weight_decay_include: list[str] = field(default_factory=list)
    weight_decay_exclude: list[str] = field(default_factory=list)
    lr_scale: list[tuple[str, float]] = field(default_factory=list)  # (rule, multiplier), first match wins
    # (rule, weight decay) replacing ``weight_decay`` for the parameters that decay; first match wins
    weight_decay_values: list[tuple[str, float]] = field(default_factory=list)


class OptimizerSpec(BaseModel):
    """The keys every optimizer type takes: parameter grouping and lmforge's extensions."""

    model_config = ConfigDict(extra="allow")

    type: str
    weight_decay: WeightDecay = 0.01
    weight_decay_include: IncludeRules = Field(default_factory=list)
    weight_decay_exclude: ExcludeRules = Field(default_factory=list)
    weight_decay_values: WeightDecayValues = Field(default_factory=list)
    lr_scale: LrScale = Field(default_factory=list)
    # Always true in effect (gradients of bf16/fp16 parameters reduce in fp32); false is warned about.
    accumulate_allreduce_grads_in_fp32: Bool = True
    offload_states: Bool = False
    # The original AdamW's spelling of offload_states (rejected there); lmforge implements it.
    enable_cpu_offload: Bool | None = None
    moment_dtype: MomentDtype = "float32"  # "float32" or "bfloat16" (lmforge.optim.moment_dtype)

    # Keys of the original that choose its kernel: lmforge always steps its fp32 masters with torch's
    # fused AdamW kernel, so a written one is warned about.
    KERNEL_KEYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def accepted_keys(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    def grouping(self) -> GroupingOptions:
        return GroupingOptions(
            weight_decay=self.weight_decay,
            weight_decay_include=list(self.weight_decay_include),
            weight_decay_exclude=list(self.weight_decay_exclude),
            lr_scale=list(self.lr_scale),
            weight_decay_values=list(self.weight_decay_values),
        )

    @model_validator(mode="after")
    def _offload_spelling(self) -> OptimizerSpec:
        if self.enable_cpu_offload is not None:
            self.offload_states = self.enable_cpu_offload
        return self


class _CompressedMomentsRefused(OptimizerSpec):
    @model_validator(mode="after")
    def _float32_moments_only(self) -> _CompressedMomentsRefused:
        if self.moment_dtype != "float32":
            raise KeyProblem(
                "moment_dtype",
                f"compressed (bf16) moments are implemented for AdamW and Muon, not {self.type}; remove the "
                "key or use type: AdamW / Muon.",
            )
        return self


class AdamWSpec(OptimizerSpec):
    type: Literal["AdamW"]
    betas: Betas = (0.9, 0.95)
    eps: Eps = 1e-8
    amsgrad: Bool = False
    maximize: Bool = False
    use_fused: Any = None
    enable_fused_opt: Any = None

    KERNEL_KEYS: ClassVar[tuple[str, ...]] = ("enable_fused_opt", "use_fused")


class LionSpec(_CompressedMomentsRefused):
    """Lion (Chen et al. 2023): sign of an interpolated momentum; decay as in AdamW."""

    type: Literal["Lion"]
    betas: Betas = (0.9, 0.99)


class LAMBSpec(_CompressedMomentsRefused):
    """LAMB (You et al. 2020): Adam direction with a per-parameter trust ratio."""

    type: Literal["LAMB"]
    betas: Betas = (0.9, 0.999)
    eps: Eps = 1e-6


class MuonSpec(OptimizerSpec):
    type: Literal["Muon"]
    weight_decay: WeightDecay = 0.1
    matched_adamw_rms: Number = 0.2
    momentum: Number = 0.95
    eps: Eps = 1e-7  # Newton-Schulz's eps, as in the original
    nesterov: Bool = True
    ns_steps: Int = 5  # the number of steps of the schedule (a segmented one sets its own)
    ns_coefficients: Any = DEFAULT_NS_COEFFICIENTS
    adamw_betas: Betas = (0.95, 0.95)
    adamw_eps: Eps = 1e-8
    qk_clip_enabled: Bool = True
    qk_clip_threshold: Number = 100.0
    comm_strategy: CommStrategy = "allgather"
    use_fused_adamw: Bool = False
    adamw_include: AdamwInclude = Field(default_factory=lambda: list(DEFAULT_ADAMW_INCLUDE))
    ns_dtype: NsDtype = "bfloat16"
    # The original's swap switch, which its Muon refuses; for the other types it is an unused key (warned).
    swap: Any = None

    KERNEL_KEYS: ClassVar[tuple[str, ...]] = ("use_fused_adamw",)

    # One (a, b, c) per Newton-Schulz step, made of ns_coefficients and ns_steps.
    _ns_schedule: Schedule = PrivateAttr(default=())

    @property
    def ns_schedule(self) -> Schedule:
        return self._ns_schedule

    @model_validator(mode="after")
    def _muon_checks(self) -> MuonSpec:
        if self.swap:
            raise KeyProblem("swap", "Muon does not support swap.")
        for key in ("offload_states", "enable_cpu_offload"):
            if getattr(self, key):
                raise KeyProblem(key, "state offload is implemented for AdamW, Lion and LAMB, not Muon.")
        if not 0.0 <= self.momentum < 1.0:
            raise KeyProblem("momentum", f"must be >= 0 and < 1, got {self.momentum}.")
        if self.matched_adamw_rms <= 0:
            raise KeyProblem("matched_adamw_rms", f"must be > 0, got {self.matched_adamw_rms}.")
        try:
            self._ns_schedule, self.ns_steps = normalize_ns_schedule(self.ns_coefficients, self.ns_steps)
        except ValueError as exc:
            key = "ns_steps" if str(exc).startswith("ns_steps") else "ns_coefficients"
            raise KeyProblem(key, str(exc)) from None
        if self.qk_clip_enabled and self.qk_clip_threshold <= 0:
            raise KeyProblem(
                "qk_clip_threshold", f"qk_clip_threshold must be positive, got {self.qk_clip_threshold}."
            )
        return self


# In the order the valid types are listed in messages (AdamW, the default, first).
OPTIMIZER_TYPES: dict[str, type[OptimizerSpec]] = {
    "AdamW": AdamWSpec,
    "Muon": MuonSpec,
    "Lion": LionSpec,
    "LAMB": LAMBSpec,
}
SPEC_CLASSES = tuple(OPTIMIZER_TYPES.values())
Hyper = AdamWSpec | MuonSpec | LionSpec | LAMBSpec


@dataclass
class OptimizerOptions:
    """The typed ``optimizer`` section: the grouping every type shares and the validated schema of
    ``type`` (``hyper``, one class per type, so a builder reads attributes, never string keys)."""

    type: str
    grouping: GroupingOptions
    hyper: Hyper
    ignored_keys: list[str] = field(default_factory=list)
