"""From a validated ``TrainConfig`` to a ready :class:`Trainer` (DESIGN §4).

config ─ preflight (RunPlan: every check, no process group) ─ process group (one process too)
       ─ build_model on meta ─ parallelize (FSDP2 at every world size) ─ materialise ─ init weights
       ─ build_scheduler ─ build_optimizer ─ ScheduleLR ─ build_dataloader (at the resume position)

One build and numerics path on every world size, one device included: the parameters are fp32 DTensors
(the master weights) and the optimizer states fp32 next to them; FSDP2's ``MixedPrecisionPolicy``
gathers each layer in ``compute_dtype`` for compute and reduces gradients in fp32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lmforge.config.schema import TrainConfig
from lmforge.config.sections_components import ModelConfig
from lmforge.config.sections_parallel import ParallelismConfig
from lmforge.config.sections_run import LoraConfig
from lmforge.config.sections_speed import Float8Config
from lmforge.errors import ConfigError, DataError, LmforgeError, TrainingFailed
from lmforge.train.callbacks.monitor import ActivationPlanCallback
from lmforge.train.parallel_seam import ParallelContext, distributed_env
from lmforge.train.rng import seed_everything
from lmforge.train.trainer import Trainer
from lmforge.train.watchdog import hang_watchdog
from lmforge.utils.logging import get_logger, setup_logging

logger = get_logger("lmforge.train")


def _activation_hook(cfg: TrainConfig, num_layers: int, has_comm_ops: bool, pp: int, plans: list[Any]):
    """Recompute / swap, applied on one device too (the original only applies them when parallel); the
    plan applied is appended to ``plans`` (for the trainer's ``ActivationPlanCallback``)."""
    from lmforge.parallel.plan import activation_wanted

    wanted = activation_wanted(cfg)
    if not wanted:
        return None
    from lmforge.parallel.activation import apply_activation_memory

    def apply(model: torch.nn.Module) -> None:
        plan = apply_activation_memory(
            model,
            cfg.recompute,
            cfg.recompute_comm,
            cfg.swap,
            num_layers,
            pipeline_parallel=pp,
            has_comm_ops=has_comm_ops,
        )
        plans.append(plan)
        logger.info("Activation memory: %s", plan.summary())

    return apply


def _maybe_float8(model: torch.nn.Module, section: Float8Config | None) -> None:
    """Float8 Linear layers first: before tensor parallel, recompute, compile and FSDP2 wrap the blocks."""
    if section is not None and section.enable:
        from lmforge.parallel.float8 import apply_float8

        apply_float8(model, section)


def _with_compile(hook: Any, cfg: TrainConfig):
    """Regional compile after recompute/swap wrapped the blocks and before FSDP2 shards them."""
    section = cfg.compile
    if not section.enable:
        return hook
    from lmforge.parallel.compile import compile_blocks

    def apply(model: torch.nn.Module) -> None:
        if hook is not None:
            hook(model)
        compile_blocks(model, section)

    return apply


def _with_offload(section: ParallelismConfig, optimizer: Any, device: torch.device) -> ParallelismConfig:
    """``optimizer.offload_states`` on an accelerator is FSDP2's CPU offload: the optimizer states live
    next to the fp32 parameters, so both go to host memory and the update runs there (on a CPU they
    already are)."""
    if device.type == "cpu" or not optimizer.hyper.offload_states:
        return section
    return section.model_copy(update={"cpu_offload": True})


def _storage_device(section: ParallelismConfig, device: torch.device) -> torch.device:
    """Where the sharded parameters are materialised: host memory under FSDP2's CPU offload."""
    return torch.device("cpu") if section.cpu_offload else device


def find_tokenizer(cfg: TrainConfig) -> Path | None:
    """The tokenizer.json of the run's data: ``train_dataset.dataloader.tokenizer`` if it is a local
    path, else a tokenizer.json next to the first training data prefix (as ``lmforge data demo`` lays out)."""
    for c in map(Path, cfg.train_dataset.dataloader.typed.tokenizer_candidates()):
        file = c / "tokenizer.json" if c.is_dir() else c
        if file.is_file() and file.name.endswith(".json"):
            return file
    return None


def _apply_lora(model: torch.nn.Module, section: LoraConfig) -> None:
    """Adapters from ``lora_config`` on the model built on meta (before any parallel wrapping; they are
    initialised with the rest, after materialising)."""
    from lmforge.models.lora import apply_lora, lora_summary

    apply_lora(model, section)
    logger.info(lora_summary(model))


def _refuse_absurd_model(cfg: TrainConfig, device: str | None, world_size: int) -> None:
    """Model dimensions whose weights cannot fit are refused before any model is built (also on meta)."""
    from lmforge.errors import LmforgeError
    from lmforge.models import build_model_config
    from lmforge.utils.model_size import check_model_fits

    try:
        model_cfg = build_model_config(cfg.model)
    except LmforgeError:
        return  # preflight reports the model section's own problems
    check_model_fits(model_cfg, device, world_size)


def build_training_model(
    section: ModelConfig,
    *,
    seed: int,
    device: str | None = None,
    parallelism: ParallelismConfig | None = None,
    before_fsdp: Any = None,
) -> tuple[torch.nn.Module, ParallelContext]:
    """A model built as the trainer builds it, for tools and benchmarks (``build_trainer`` adds recompute,
    compile, float8 and LoRA): process group (one process too), meta build, ``parallelize`` (FSDP2 with
    fp32 parameters, compute in ``compute_dtype``), materialise, ``init_weights(seed)``. Returns the model
    and the ``ParallelContext`` for ``TrainStep``. ``before_fsdp(model)`` runs where ``build_trainer``
    applies recompute and compile."""
    from lmforge.models import build_model
    from lmforge.parallel import parallelize
    from lmforge.parallel.dims import ParallelDims

    parallelism = parallelism if parallelism is not None else ParallelismConfig()
    ctx = distributed_env(device)
    dims = ParallelDims.from_section(parallelism, ctx.world_size)
    model = build_model(section, device="meta")
    model, info = parallelize(
        model,
        dims,
        dims.build_mesh(ctx.device.type),
        parallelism,
        apply_activation=before_fsdp,
        device=ctx.device,
    )
    model.to_empty(device=_storage_device(parallelism, ctx.device))
    with torch.no_grad():
        model.init_weights(int(seed))
    ctx = ctx.placed(info)
    return model, ctx


def _claim_run_dirs(rank: int, run_dir: Path, cfg: TrainConfig) -> None:
    """Rank 0 refuses now, before anything is written, an unusable output_dir or one that another run
    uses (the trainer holds the locks while it runs), and an unreachable tracker store. A collective:
    only rank 0 checks, so the other ranks stop quietly with its error instead of failing in the next
    collective."""
    from lmforge.utils.atomic import check_output_dir
    from lmforge.utils.elastic import raise_on_every_rank
    from lmforge.utils.run_lock import lock_dirs, run_dirs

    problem = None
    if rank == 0:
        try:
            check_output_dir(run_dir, "output_dir")
            for lock in lock_dirs(
                run_dirs(run_dir, cfg.checkpoint.save_path if cfg.checkpoint.enable_save else None)
            ):
                lock.release()
            run_dir.mkdir(parents=True, exist_ok=True)
            from lmforge.train.callbacks.tracker_settings import open_tracker_stores

            open_tracker_stores(
                cfg.monitor, run_dir
            )  # an unreachable MLflow store fails before the model exists
        except LmforgeError as exc:
            problem = exc
    raise_on_every_rank(problem)


def build_trainer(
    cfg: TrainConfig, *, output_dir: str | os.PathLike | None = None, device: str | None = None
) -> Trainer:
    """Build everything a run needs from ``cfg`` (one process or under torchrun)."""
    from lmforge.config.outputs import with_output_dir
    from lmforge.lr import ScheduleLR
    from lmforge.models import load_hf_weights
    from lmforge.optim import build_optimizer

    if output_dir is not None:
        # --output-dir moves every output, including the paths the file puts under its own output_dir.
        cfg = with_output_dir(cfg, output_dir)
    plan = _checked_plan(cfg, device)  # every configuration error, before anything exists
    if cfg.training.epochs is not None:  # the trainer, its checkpoints and callbacks see the steps
        cfg = cfg.with_derived_steps(plan.total_steps)
    ctx = distributed_env(device, float(cfg.parallelism.process_group_timeout))
    run_dir = _open_run_dir(cfg, plan, ctx)
    seed_everything(int(cfg.training.seed), bool(cfg.training.deterministic))
    model, info, activation_plans = _build_model(cfg, plan, ctx)
    ctx = ctx.placed(info)
    # QK-Clip reduces max logits over the ranks holding the same layers (not across pipeline stages).
    optimizer = build_optimizer(plan.optimizer, model, plan.schedule, qk_clip_group=info.qk_clip_group)
    tokenizer = find_tokenizer(cfg)
    return Trainer(
        cfg,
        model=model,
        optimizer=optimizer,
        scheduler=ScheduleLR(optimizer, plan.schedule),
        dataloader_factory=_dataloader_factory(cfg, plan, ctx),
        ctx=ctx,
        output_dir=run_dir,
        hf_loader=load_hf_weights,
        files_to_copy=[tokenizer] if tokenizer else None,
        batches=plan.batches,
        callbacks=hang_watchdog(float(cfg.parallelism.process_group_timeout), ctx.rank, ctx.world_size)
        + [ActivationPlanCallback(plan) for plan in activation_plans],
    )


def _checked_plan(cfg: TrainConfig, device: str | None) -> Any:
    """The run plan, or the ConfigError / DataError naming every problem; nothing is built yet."""
    from lmforge.data.files import TRAINING_KEYS, cache_dir_problems, missing_data_files, text_loader_problem
    from lmforge.train.checkpoint.resume import load_path_problem
    from lmforge.train.preflight import preflight
    from lmforge.train.recovery.give_up import give_up_problem
    from lmforge.utils.elastic import launch_env

    world_size = launch_env().world_size  # every torchrun variable checked, before anything starts
    _refuse_absurd_model(cfg, device, world_size)
    plan = preflight(cfg, world_size, device)
    missing = missing_data_files(cfg.train_dataset, TRAINING_KEYS)
    problems = missing + cache_dir_problems(cfg.train_dataset, cfg.eval_dataset)  # each with its advice
    text = text_loader_problem(cfg.train_dataset, plan.model_config.seq_length, plan.model_config.vocab_size)
    problems += [text] if text is not None else []
    if problems:
        advice = (
            "; create the data (e.g. 'lmforge data preprocess') or point the path at it" if missing else ""
        )
        raise DataError("; ".join(problems) + ". Nothing was built" + advice + ".")
    empty_load_path = load_path_problem(cfg.checkpoint)
    if empty_load_path is not None:
        raise ConfigError(empty_load_path)
    gave_up = give_up_problem(cfg.checkpoint)  # recovery gave up in save_path: a restart must not retry
    if gave_up is not None:
        raise TrainingFailed(gave_up)
    return plan


def _open_run_dir(cfg: TrainConfig, plan: Any, ctx: ParallelContext) -> Path:
    """The run directory, claimed by rank 0 (``_claim_run_dirs``), with logging into it set up."""
    from lmforge.train.preflight import compute_dtype_report

    run_dir = Path(cfg.output_dir or "./output")
    _claim_run_dirs(ctx.rank, run_dir, cfg)
    # Logging first, so that model / optimizer construction messages reach train.log too.
    setup_logging(log_file=str(run_dir / "train.log") if ctx.rank == 0 else None)
    for note in plan.warnings_beyond(cfg.warnings):  # load_config logged those
        logger.warning("%s", note)
    logger.info("%s", compute_dtype_report(plan.model_config, ctx.device.type)[0])
    return run_dir


def _build_model(cfg: TrainConfig, plan: Any, ctx: ParallelContext) -> tuple[torch.nn.Module, Any, list[Any]]:
    """Meta build, float8 / LoRA, ``parallelize`` (recompute, swap and compile in its hook), materialise,
    layout-invariant init; returns the model, the ``ParallelInfo`` and the activation plans applied."""
    from lmforge.models.build import build_from_config
    from lmforge.parallel import parallelize

    model_cfg, dims, seed = plan.model_config, plan.dims, int(cfg.training.seed)
    activation_plans: list[Any] = []
    hook = _activation_hook(
        cfg, model_cfg.num_layers, dims.tp * dims.cp * dims.ep > 1, dims.pp, activation_plans
    )
    hook = _with_compile(hook, cfg)
    float8 = cfg.float8
    if float8.enable:
        from lmforge.parallel.float8 import check_float8_supported

        check_float8_supported(float8, ctx.device, dims.tp)
    lora = cfg.lora_config  # the run plan refused it with pipeline parallel
    model = build_from_config(model_cfg, plan.model_class, device="meta")
    _maybe_float8(model, float8)
    if lora is not None:
        _apply_lora(model, lora)
    parallelism = _with_offload(cfg.parallelism, plan.optimizer, ctx.device)
    model, info = parallelize(
        model,
        dims,
        dims.build_mesh(ctx.device.type),
        parallelism,
        num_microbatches=plan.accumulation_steps,
        apply_activation=hook,
        device=ctx.device,
    )
    model.to_empty(device=_storage_device(parallelism, ctx.device))
    with torch.no_grad():
        model.init_weights(seed)  # layout-invariant: the same weights on every layout
    if lora is not None:
        from lmforge.models.lora import init_lora_weights

        init_lora_weights(model, seed)
    logger.info(
        "Model %s: %.2fM parameters, %s; parallel: %s",
        cfg.model.architectures,
        sum(p.numel() for p in model.parameters()) / 1e6,
        getattr(model, "compute_dtype", next(model.parameters()).dtype),
        dims.describe(),
    )
    return model, info, activation_plans


def _dataloader_factory(cfg: TrainConfig, plan: Any, ctx: ParallelContext):
    """``consumed_samples -> loader``: the trainer builds the loader at the position it resumes from."""
    from lmforge.data import build_dataloader

    training, model_cfg = cfg.training, plan.model_config

    def factory(consumed_samples: int) -> Any:
        loader = build_dataloader(
            cfg.train_dataset,
            local_batch_size=int(training.local_batch_size),
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp_size,
            seed=int(training.seed),
            vocab_size=model_cfg.vocab_size,
            seq_length=model_cfg.seq_length,
            consumed_samples=consumed_samples,
        )
        if loader is None:
            raise ConfigError(
                "train_dataset: the training split is empty; check train_dataset.dataloader.config "
                "(train_data_path / data_path and split)."
            )
        return loader

    return factory
