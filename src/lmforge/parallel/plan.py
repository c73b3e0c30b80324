"""The run plan: every check of a configuration that needs no process, and what the run will do.

``RunPlan.from_config(cfg, world_size)`` is the second half of validation (``load_config`` is the
first, and types every section: the model's ``TransformerConfig``, the optimizer's options, the lr
schedule and the data loader are ``cfg.<section>.typed``, which the plan reads), computes the
parallel degrees, the data-parallel size, the batch schedule (ramp-up included) and the
accumulation steps once, and runs the checks that need the model's structure (degrees against
heads and layers, recompute/swap module patterns) on a model built on the meta device, so that no
weight is allocated. Every problem is collected and raised as one :class:`ConfigError` before
anything is built; warnings are collected in ``plan.warnings`` instead of being logged.

``lmforge check`` prints the plan; ``lmforge train`` builds the model, loader, step and trainer
from it. Nothing else computes degrees, accumulation steps or the batch schedule.
"""

from __future__ import annotations

import contextlib
import logging
import warnings as py_warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lmforge.config.base import OpenSection
from lmforge.config.load import collected_log_warnings
from lmforge.config.schema import TrainConfig
from lmforge.config.sections_run import TrainingConfig
from lmforge.errors import ConfigError, LmforgeError
from lmforge.lr import build_scheduler
from lmforge.parallel.dims import ParallelDims


@dataclass(frozen=True)
class BatchSchedule:
    """How many samples (and micro-batches per data-parallel rank) each step consumes.

    Ramp-up ``[start, increment, rampup_samples]`` follows the original: the global batch after
    ``consumed`` samples is ``min(start + floor(consumed / (rampup_samples / n)) * increment, gbs)``
    with ``n = (gbs - start) // increment`` increments; past ``rampup_samples`` it is ``gbs``.
    The spec's floor division: ``gbs // (dp * lbs)`` micro-batches per rank and step.
    """

    global_batch_size: int
    local_batch_size: int
    data_parallel: int
    rampup: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, training: TrainingConfig, data_parallel: int) -> BatchSchedule:
        """The schedule of the typed ``training`` section for ``data_parallel`` ranks (the one way to make
        one: the run plan, the trainer, the planner and ``lmforge check`` all ask it)."""
        rampup = training.rampup_batch_size
        return cls(
            global_batch_size=int(training.global_batch_size),
            local_batch_size=int(training.local_batch_size),
            data_parallel=data_parallel,
            rampup=tuple(rampup) if rampup else None,  # type: ignore[arg-type]
        )

    @property
    def samples_per_micro_step(self) -> int:
        return self.local_batch_size * self.data_parallel

    def global_batch_at(self, consumed_samples: int) -> int:
        """The configured global batch size of the step that starts after ``consumed_samples``."""
        if self.rampup is None:
            return self.global_batch_size
        start, inc, rampup_samples = self.rampup
        increments = (self.global_batch_size - start) // inc
        if increments <= 0 or rampup_samples == 0 or consumed_samples >= rampup_samples:
            return self.global_batch_size
        samples_per_increment = rampup_samples / increments
        return min(start + int(consumed_samples // samples_per_increment) * inc, self.global_batch_size)

    def accumulation_steps_at(self, consumed_samples: int) -> int:
        return max(self.global_batch_at(consumed_samples) // self.samples_per_micro_step, 1)

    def samples_of_step_at(self, consumed_samples: int) -> int:
        """Samples the step actually consumes: accumulation steps x dp x local batch.

        The original advances consumed_samples by the configured batch even when floor division
        trains on fewer samples; lmforge counts what was trained on, so resuming lands on the next
        unseen sample.
        """
        return self.accumulation_steps_at(consumed_samples) * self.samples_per_micro_step

    def steps_within(self, samples: int) -> int:
        """How many whole steps fit in ``samples`` samples (all data-parallel ranks together): the
        length of a run of ``training.epochs`` passes, whose last partial global batch is not trained."""
        steps = consumed = 0
        while self.rampup is not None and consumed < self.rampup[2]:  # ramp-up: step by step
            size = self.samples_of_step_at(consumed)
            if consumed + size > samples:
                return steps
            steps, consumed = steps + 1, consumed + size
        return steps + (samples - consumed) // self.samples_of_step_at(consumed)

    def problems(self) -> list[str]:
        """Why this schedule cannot run (empty when it can)."""
        per_step = self.samples_per_micro_step
        if self.rampup is None:
            if per_step > self.global_batch_size:
                return [
                    "training.global_batch_size: The product of data_parallel and local_batch_size exceeds "
                    "global_batch_size, please increase global_batch_size or decrease local_batch_size "
                    f"(data_parallel {self.data_parallel} x training.local_batch_size {self.local_batch_size} "
                    f"= {per_step} > training.global_batch_size {self.global_batch_size})."
                ]
            return []
        start, inc, _ = self.rampup
        for gbs in range(start, self.global_batch_size + 1, inc):
            if gbs % per_step != 0:
                return [
                    f"training.rampup_batch_size: the global batch size {gbs} during ramp-up is not a "
                    f"multiple of data_parallel x local_batch_size = {per_step}."
                ]
        return []

    def warnings(self) -> list[str]:
        per_step = self.samples_per_micro_step
        if self.rampup is not None or self.global_batch_size % per_step == 0:
            return []
        acc = self.accumulation_steps_at(0)
        return [
            f"training.global_batch_size {self.global_batch_size} is not a multiple of data_parallel "
            f"({self.data_parallel}) x local_batch_size ({self.local_batch_size}) = {per_step}: each step "
            f"accumulates {acc} micro-batch(es), so the effective global batch is {acc * per_step} samples."
        ]


def accumulation_steps(global_batch_size: int, local_batch_size: int, dp: int) -> int:
    """Micro-batches per step without ramp-up: ``global_batch_size // (dp × local_batch_size)`` (the
    spec's floor division); a ConfigError when ``dp × local_batch_size`` exceeds the global batch."""
    schedule = BatchSchedule(global_batch_size, local_batch_size, dp)
    problems = schedule.problems()
    if problems:
        raise ConfigError(problems[0])
    return schedule.accumulation_steps_at(0)


@dataclass(frozen=True)
class RunPlan:
    """What a configuration means for ``world_size`` processes; built only from valid configurations."""

    world_size: int
    dims: ParallelDims
    model_config: Any  # lmforge.models.TransformerConfig
    model_class: type
    optimizer: Any  # lmforge.optim.OptimizerOptions
    schedule: Any  # lmforge.lr.Schedule
    batches: BatchSchedule
    total_steps: int
    activation_summary: str | None = None
    # training.epochs: how the steps were derived from the data (None when training.steps gives them)
    epochs_note: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    # ------------------------------------------------------------------ derived numbers
    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank in the first step (the pipeline's micro-batch count)."""
        return self.batches.accumulation_steps_at(0)

    @property
    def effective_global_batch_size(self) -> int:
        return self.batches.samples_of_step_at(0)

    @property
    def tokens_per_step(self) -> int:
        return self.effective_global_batch_size * int(self.model_config.seq_length)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        cfg: TrainConfig,
        world_size: int,
        *,
        extra_checks: tuple[Callable[[Any], None], ...] = (),
    ) -> RunPlan:
        """Check ``cfg`` (a ``TrainConfig``) for ``world_size`` processes; one ConfigError lists every problem.

        ``extra_checks`` are callables of the config raising :class:`LmforgeError` (the trainer adds
        the callback list); their problems are reported with the others.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"the world size must be a positive integer, got {world_size!r}.")
        problems: list[str] = []
        notes: list[str] = []
        with collected_warnings(notes):
            plan = _plan(cfg, world_size, problems)
            for check in extra_checks:
                _attempt(problems, lambda check=check: check(cfg))
        if problems:
            if len(problems) == 1:
                raise ConfigError(f"Invalid configuration: {problems[0]}")
            numbered = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
            raise ConfigError(f"Invalid configuration, {len(problems)} problems: {numbered}")
        if plan is None:  # every path that yields no plan records a problem; kept explicit for safety
            raise ConfigError("Invalid configuration: the run plan could not be computed.")
        ordered = list(dict.fromkeys([*plan.warnings, *notes]))
        return _replace(plan, warnings=tuple(ordered))

    def warnings_beyond(self, earlier: tuple[str, ...] | list[str]) -> list[str]:
        """The plan's warnings that ``earlier`` (``cfg.warnings``, logged by ``load_config``) does not
        already hold. The inert fields have one table (``lmforge.config.inert``), read at load only."""
        seen = set(earlier)
        return [n for n in self.warnings if n not in seen]

    # ------------------------------------------------------------------ printing
    def describe(self, cfg: TrainConfig) -> list[str]:
        """The lines ``lmforge check`` prints under "Run plan"."""
        d, b, par = self.dims, self.batches, cfg.parallelism
        lines = [
            f"  world size {self.world_size}: {d.describe()}",
            f"  data parallel: {d.dp} (replicate {d.dp_replicate} x shard {d.dp_shard}); tensor {d.tp}, "
            f"pipeline {d.pp}, context {d.cp}, expert {d.ep}; sequence parallel "
            f"{'on' if par.sequence_parallel else 'off'}",
            f"  gradient accumulation steps: {self.accumulation_steps} = global_batch_size "
            f"{b.global_batch_at(0)} // (local_batch_size {b.local_batch_size} x data parallel {d.dp})",
            f"  effective global batch: {self.effective_global_batch_size} samples per step",
            f"  tokens per step: {self.tokens_per_step} (seq_length {self.model_config.seq_length})",
        ]
        if b.rampup is not None:
            start, inc, samples = b.rampup
            lines.append(
                f"  batch ramp-up: global batch {start} growing by {inc} up to {b.global_batch_size} over "
                f"the first {samples} samples"
            )
        lines.append(f"  total steps: {self.total_steps}")
        if self.epochs_note:
            lines.append(f"  {self.epochs_note}")
        lines.append(f"  learning rate: {self.schedule.description}")
        boundaries = self.schedule.boundaries()
        lines.append(f"  warm-up steps: {boundaries.get('warm-up end') or 0}")
        lines += [f"  {name}: step {step}" for name, step in boundaries.items() if name != "warm-up end"]
        if self.activation_summary:
            lines.append(f"  activation memory: {self.activation_summary}")
        return lines


def _replace(plan: RunPlan, **changes: Any) -> RunPlan:
    import dataclasses

    return dataclasses.replace(plan, **changes)


def _attempt(problems: list[str], fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except LmforgeError as exc:
        problems.append(_strip(str(exc)))
        return None


def _strip(text: str) -> str:
    # A nested whole-configuration message keeps only its problem list.
    for prefix in ("Invalid configuration: ",):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


@contextlib.contextmanager
def collected_warnings(notes: list[str]) -> Iterator[None]:
    """Collect the building blocks' warnings (log records and ``warnings.warn``) instead of printing them."""

    with collected_log_warnings(notes), py_warnings.catch_warnings(record=True) as caught:
        py_warnings.simplefilter("always")
        yield
    notes.extend(str(w.message) for w in caught)


def _plan(cfg: TrainConfig, world_size: int, problems: list[str]) -> RunPlan | None:

    training = cfg.training
    # load_config typed the model, optimizer and lr_scheduler sections (lmforge.config.registry): the
    # plan reads those typed forms and validates nothing again. The schedule over training.steps is the
    # typed scheduler's (load_config made it once already: it cannot fail, and its warnings are in
    # cfg.warnings).
    typed_model = _typed(cfg.model, "model", problems)
    model_config, model_class = (typed_model.config, typed_model.model_class) if typed_model else (None, None)
    optimizer = _typed(cfg.optimizer, "optimizer", problems)
    scheduler = _typed(cfg.lr_scheduler, "lr_scheduler", problems)
    # With training.epochs the schedule's total is derived below, from the data.
    schedule = (
        scheduler.schedule(int(training.steps)) if scheduler is not None and training.epochs is None else None
    )
    dims = _attempt(problems, lambda: ParallelDims.from_section(cfg.parallelism, world_size))
    batches = None
    if dims is not None:
        batches = BatchSchedule.of(training, dims.dp)
        problems += batches.problems()
        if dims.pp > 1 and batches.rampup is not None:
            problems.append(
                "training.rampup_batch_size cannot be combined with parallelism.pipeline_parallel > 1: the "
                "pipeline schedule runs a fixed number of micro-batches per step."
            )
    lora = cfg.lora_config
    if lora is not None and dims is not None and dims.pp > 1:
        problems.append(
            f"lora_config cannot be combined with parallelism.pipeline_parallel ({dims.pp}) > 1 yet: LoRA "
            "composes with data parallel (FSDP2/HSDP) and tensor parallel only. Remove lora_config or set "
            "parallelism.pipeline_parallel: 1."
        )
    summary = None
    if dims is not None and model_config is not None:
        summary = _check_model_structure(cfg, dims, model_config, model_class, optimizer, problems)
    total_steps, epochs_note = int(training.steps), None
    if training.epochs is not None and batches is not None and model_config is not None:
        derived = _attempt(problems, lambda: _steps_of_epochs(cfg, batches, model_config))
        if derived is not None:
            total_steps, schedule, epochs_note = derived
    if problems or batches is None:
        return None
    return RunPlan(
        world_size=world_size,
        dims=dims,
        model_config=model_config,
        model_class=model_class,
        optimizer=optimizer,
        schedule=schedule,
        batches=batches,
        total_steps=total_steps,
        activation_summary=summary,
        epochs_note=epochs_note,
        warnings=tuple(batches.warnings()),
    )


def _steps_of_epochs(cfg: TrainConfig, batches: BatchSchedule, model_config: Any) -> tuple[int, Any, str]:
    """(steps, lr schedule over them, a line for ``check``) of ``training.epochs`` passes over the data."""
    from lmforge.data.epochs import samples_of_epochs

    epochs = int(cfg.training.epochs)
    try:
        length = samples_of_epochs(
            cfg.train_dataset,
            epochs,
            local_batch_size=batches.local_batch_size,
            dp_size=batches.data_parallel,
            seed=int(cfg.training.seed),
            seq_length=model_config.seq_length,
            vocab_size=model_config.vocab_size,
        )
    except LmforgeError as exc:  # the data must be readable now: the steps are counted from it
        if str(exc).startswith("training.epochs"):
            raise
        raise type(exc)(f"training.epochs {epochs} counts the steps from the training data: {exc}") from None
    steps = batches.steps_within(length.samples)
    if steps < 1:
        raise ConfigError(
            f"training.epochs: {epochs} pass(es) over the training data give {length.samples} samples "
            f"({length.description}), fewer than one step of {batches.samples_of_step_at(0)} samples; use more "
            "epochs or data, or a smaller training.global_batch_size."
        )
    try:
        # The typed scheduler over the derived total, checked as load_config checks an explicit
        # training.steps; its warnings go to plan.warnings (from_config collects the log).
        schedule = build_scheduler(cfg.lr_scheduler, steps)
    except ValueError as exc:
        raise ConfigError(f"{exc} (training.steps {steps} derived from training.epochs {epochs})") from None
    note = (
        f"steps from training.epochs {epochs}: {length.samples} samples ({length.description}) in whole "
        f"steps of the batch schedule = {steps} steps"
    )
    return steps, schedule, note


def _typed(section: OpenSection, path: str, problems: list[str]) -> Any:
    typed = section.typed
    if typed is None:  # a registered schema returned nothing (a plugin's bug): nothing can be built
        kind = getattr(section, "type", None) or getattr(section, "model_type", None)
        problems.append(f"{path}: no registered schema typed this section (type {kind!r}).")
    return typed


def activation_wanted(cfg: TrainConfig) -> bool:
    """Whether recompute, recompute_comm or swap asks for anything."""
    mode = cfg.recompute.mode
    return (mode not in (None, "None")) or bool(cfg.recompute_comm.enable) or bool(cfg.swap.enable)


def _check_model_structure(
    cfg: TrainConfig,
    dims: ParallelDims,
    model_config: Any,
    model_class: type,
    optimizer: Any,
    problems: list[str],
) -> str | None:
    """Degrees against the model, unsupported combinations, recompute/swap and parameter-name
    patterns (on a model built on the meta device: no weights)."""
    from lmforge.errors import NotSupportedError
    from lmforge.models.build import build_from_config
    from lmforge.parallel.api import refuse_unsupported
    from lmforge.utils.name_patterns import unmatched

    mc = model_config
    _attempt(
        problems,
        lambda: dims.check_transformer(mc, cfg.parallelism, seq_length=mc.seq_length),
    )
    patterns = _parameter_patterns(cfg, optimizer)
    lora = cfg.lora_config
    if not (dims.is_parallel or activation_wanted(cfg) or patterns or lora is not None):
        return None
    model = build_from_config(mc, model_class, "meta")
    if lora is not None:  # target_modules / exclude_layers select at least one linear module
        from lmforge.models.lora import select_lora_targets

        _attempt(problems, lambda: select_lora_targets(model, lora))
        clip_layers = getattr(model, "qk_clip_layers", None)
        if (
            optimizer is not None
            and optimizer.type == "Muon"
            and optimizer.hyper.qk_clip_enabled
            and callable(clip_layers)
            and any(layer.targets for layer in clip_layers())
        ):
            problems.append(
                "optimizer.qk_clip_enabled: QK-Clip rescales the q/k projection weights (or the QK-norm gains), "
                "which lora_config freezes, and it does not see the adapters' update; set "
                "optimizer.qk_clip_enabled: false for a LoRA run with Muon."
            )
    if patterns:
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        for key, pattern in patterns:
            if not unmatched(names, [pattern]):
                continue
            if key == "optimizer.weight_decay_exclude" and "bias" in pattern:
                # Excluding biases is the standard list (the spec's recipes: ["*norm*", "*bias*"]) and
                # is met on a model built without them (bias is a per-model option): nothing to flag.
                continue
            hint = (
                f" It is a substring of parameter names; for the original's substring rule write "
                f"'*{pattern}*'."
                if any(pattern in n for n in names)
                else ""
            )
            logging.getLogger("lmforge.optim").warning(
                "%s: the pattern %r matches no parameter of this model, so it changes nothing (parameter "
                "names look like %s; docs/config.md#name-patterns).%s",
                key,
                pattern,
                ", ".join(names[:4]),
                hint,
            )
    if dims.is_parallel:
        try:
            refuse_unsupported(model, dims)
        except NotSupportedError as exc:
            problems.append(str(exc))
    if not activation_wanted(cfg):
        return None
    from lmforge.parallel.activation import plan_activation_memory

    plan = _attempt(
        problems,
        lambda: plan_activation_memory(
            model,
            cfg.recompute,
            cfg.recompute_comm,
            cfg.swap,
            mc.num_layers,
            pipeline_parallel=dims.pp,
            has_comm_ops=dims.tp * dims.cp * dims.ep > 1,
        ),
    )
    return None if plan is None else plan.summary()


def _parameter_patterns(cfg: TrainConfig, optimizer: Any) -> list[tuple[str, str]]:
    """(dotted key, pattern) of every parameter-name pattern the file writes in ``optimizer``."""
    if optimizer is None:
        return []
    g = optimizer.grouping
    found = [("optimizer.weight_decay_include", p) for p in g.weight_decay_include]
    found += [("optimizer.weight_decay_exclude", p) for p in g.weight_decay_exclude]
    found += [(f"optimizer.lr_scale[{p!r}]", p) for p, _ in g.lr_scale]
    found += [(f"optimizer.weight_decay_values[{p!r}]", p) for p, _ in g.weight_decay_values]
    if optimizer.type == "Muon" and "adamw_include" in optimizer.hyper.model_fields_set:
        found += [("optimizer.adamw_include", p) for p in optimizer.hyper.adamw_include]
    return found
