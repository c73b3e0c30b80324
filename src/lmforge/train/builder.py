"""From a validated ``TrainConfig`` to a ready :class:`Trainer` (DESIGN §4).

config ─ preflight (RunPlan: every check, no process group) ─ build_model (meta when parallel) ─ parallelize ─ init weights
       ─ build_scheduler ─ build_optimizer ─ ScheduleLR ─ build_dataloader (at the resume position)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import ConfigError
from lmforge.train.parallel_seam import ParallelContext, distributed_env
from lmforge.train.rng import seed_everything
from lmforge.train.trainer import Trainer
from lmforge.utils.logging import get_logger, setup_logging
from lmforge.utils.sections import section_to_dict

logger = get_logger("lmforge.train")


def _section_enabled(section: Any, key: str, off: Any) -> bool:
    values = section_to_dict(section)
    return bool(values) and values.get(key, off) not in (off, None, False)


def _activation_hook(cfg: Any, num_layers: int, has_comm_ops: bool, pp: int):
    """Recompute / swap, applied on one device too (the original only applies them when parallel)."""
    wanted = (
        _section_enabled(cfg.recompute, "mode", "None")
        or _section_enabled(cfg.recompute_comm, "enable", False)
        or _section_enabled(cfg.swap, "enable", False)
    )
    if not wanted:
        return None
    from lmforge.parallel.activation import apply_activation_memory

    def apply(model: torch.nn.Module) -> None:
        summary = apply_activation_memory(
            model,
            cfg.recompute,
            cfg.recompute_comm,
            cfg.swap,
            num_layers,
            pipeline_parallel=pp,
            has_comm_ops=has_comm_ops,
        )
        logger.info("Activation memory: %s", summary)

    return apply


def check_cpu_offload_on_one_process(section: Any, device: torch.device) -> None:
    """``parallelism.cpu_offload`` is FSDP2's CPUOffloadPolicy, applied only when the run is parallel.

    On one process there is nothing to shard: on a CPU the parameters, gradients and optimizer states
    already live in host memory (a no-op, said so); on an accelerator it would do nothing, so it is
    refused before anything is built, pointing at what does work on one device.
    """
    if not section_to_dict(section).get("cpu_offload", False):
        return
    if device.type == "cpu":
        logger.warning(
            "parallelism.cpu_offload: true has no effect on this run: it is one process on a CPU, where "
            "parameters, gradients and optimizer states are already in host memory."
        )
        return
    raise ConfigError(
        f"parallelism.cpu_offload: true is FSDP2's CPU offload and needs a parallel run (torchrun with more "
        f"than one process); on one {device.type} device it would leave everything on the accelerator. Set "
        "it to false and use optimizer.offload_states: true to keep the fp32 masters and optimizer states "
        "in host memory, or run under torchrun with --nproc_per_node >= 2."
    )


def find_tokenizer(cfg: Any) -> Path | None:
    """The tokenizer.json of the run's data: ``train_dataset.dataloader.tokenizer`` if it is a local
    path, else a tokenizer.json next to the first training data prefix (as ``lmforge data demo`` lays out)."""
    loader = section_to_dict(getattr(cfg.train_dataset, "dataloader", None))
    candidates: list[Path] = []
    tok = loader.get("tokenizer")
    if isinstance(tok, str) and tok:
        candidates.append(Path(tok))
    elif isinstance(tok, dict):
        for key in ("tokenizer_file", "path", "vocab_file"):
            if isinstance(tok.get(key), str):
                candidates.append(Path(tok[key]))
    data = loader.get("config") or {}
    for key in ("train_data_path", "data_path"):
        paths = data.get(key) or []
        for p in paths if isinstance(paths, list) else [paths]:
            if isinstance(p, str) and not _is_number(p):
                candidates.append(Path(p).parent)
    for c in candidates:
        file = c / "tokenizer.json" if c.is_dir() else c
        if file.is_file() and file.name.endswith(".json"):
            return file
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _refuse_absurd_model(cfg: Any, device: str | None, world_size: int) -> None:
    """Model dimensions whose weights cannot fit are refused before any model is built (also on meta)."""
    from lmforge.errors import LmforgeError
    from lmforge.models import build_model_config
    from lmforge.utils.model_size import check_model_fits

    try:
        model_cfg = build_model_config(cfg.model)
    except LmforgeError:
        return  # preflight reports the model section's own problems
    check_model_fits(model_cfg, device, world_size)


def build_trainer(
    cfg: Any, *, output_dir: str | os.PathLike | None = None, device: str | None = None
) -> Trainer:
    """Build everything a run needs from ``cfg`` (one process or under torchrun)."""
    from lmforge.config.outputs import with_output_dir
    from lmforge.data import build_dataloader
    from lmforge.lr import ScheduleLR
    from lmforge.models import load_hf_weights
    from lmforge.models.build import build_from_config
    from lmforge.optim import build_optimizer
    from lmforge.train.preflight import preflight

    if output_dir is not None:
        # --output-dir moves every output, including the paths the file puts under its own output_dir.
        cfg = with_output_dir(cfg, output_dir)
    # Every configuration error is raised here, before a process group, model or dataset exists.
    from lmforge.utils.device import env_int

    world_size = env_int("WORLD_SIZE", 1, minimum=1)
    _refuse_absurd_model(cfg, device, world_size)
    plan = preflight(cfg, world_size)
    ctx = distributed_env(device)
    run_dir = Path(cfg.output_dir or "./output")
    if ctx.rank == 0:
        from lmforge.utils.atomic import check_output_dir

        check_output_dir(run_dir, "output_dir")
        from lmforge.utils.run_lock import lock_dirs, run_dirs

        # Refuse now, before anything is written, if another run uses these directories (the
        # trainer holds the locks while it runs).
        for lock in lock_dirs(run_dirs(run_dir, section_to_dict(cfg.checkpoint))):
            lock.release()
        run_dir.mkdir(parents=True, exist_ok=True)
    # Logging first, so that model / optimizer construction messages reach train.log too.
    setup_logging(log_file=str(run_dir / "train.log") if ctx.rank == 0 else None)
    for note in plan.warnings:
        logger.warning("%s", note)
    training = cfg.training
    seed_everything(int(training.seed), bool(training.deterministic))
    model_cfg = plan.model_config
    dims = plan.dims
    hook = _activation_hook(cfg, model_cfg.num_layers, dims.tp * dims.cp * dims.ep > 1, dims.pp)
    if not dims.is_parallel:
        check_cpu_offload_on_one_process(cfg.parallelism, ctx.device)
        model = build_from_config(model_cfg, plan.model_class, device=ctx.device, seed=int(training.seed))
        if hook is not None:
            hook(model)
    else:
        from lmforge.parallel import parallelize

        model = build_from_config(model_cfg, plan.model_class, device="meta")
        mesh = dims.build_mesh(ctx.device.type)
        model, info = parallelize(
            model,
            dims,
            mesh,
            cfg.parallelism,
            num_microbatches=plan.accumulation_steps,
            apply_activation=hook,
            device=ctx.device,
        )
        model.to_empty(device=ctx.device)
        with torch.no_grad():
            model.init_weights(int(training.seed))  # layout-invariant: the same weights as one process
        ctx = ParallelContext(
            rank=ctx.rank,
            world_size=ctx.world_size,
            local_rank=ctx.local_rank,
            dp_rank=info.dp_rank,
            dp_size=info.dp_size,
            device=ctx.device,
            # FSDP sums gradients over data-parallel ranks; the step divides by the global token count.
            wrapper_reduces_grads=True,
            grad_reduce_is_mean=False,
            dp_group=info.dp_group,
        )
    logger.info(
        "Model %s: %.2fM parameters, %s; parallel: %s",
        getattr(cfg.model, "architectures", "?"),
        sum(p.numel() for p in model.parameters()) / 1e6,
        getattr(model, "compute_dtype", next(model.parameters()).dtype),
        dims.describe(),
    )
    schedule = plan.schedule
    # QK-Clip reduces max logits over the ranks holding the same layers (not across pipeline stages).
    qk_group = info.qk_clip_group if dims.is_parallel else None
    optimizer = build_optimizer(plan.optimizer, model, schedule, qk_clip_group=qk_group)
    scheduler = ScheduleLR(optimizer, schedule)

    def dataloader_factory(consumed_samples: int) -> Any:
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

    tokenizer = find_tokenizer(cfg)
    return Trainer(
        cfg,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataloader_factory=dataloader_factory,
        ctx=ctx,
        output_dir=run_dir,
        hf_loader=load_hf_weights,
        files_to_copy=[tokenizer] if tokenizer else None,
        batches=plan.batches,
    )
