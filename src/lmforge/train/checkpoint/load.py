"""Loading: ``load_checkpoint`` restores a run (or only weights) from a resolved checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint.files import COMMON_FILE, LEGACY_FORMAT, _distributed, _quiet_single_process
from lmforge.train.checkpoint.resolve import CheckpointHeader, _read_metadata, resolve_checkpoint
from lmforge.train.checkpoint.safe_load import load_dcp
from lmforge.train.checkpoint.state_codec import _allocate_encoded, _has_key, decode_state
from lmforge.train.checkpoint.state_dicts import (
    Checkpointable,
    _model_state_dict,
    _non_strict,
    _optimizer_options,
)
from lmforge.train.checkpoint.verify import verify_checkpoint
from lmforge.train.rng import restore_rng_state
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


NO_OPTIMIZER_MESSAGE = (
    "no_load_optim is False but no optimizer checkpoint found in {dir}. Please ensure the checkpoint "
    "directory contains optimizer weight files (optimizer state; it is absent when the checkpoint was saved "
    "with checkpoint.no_save_optim: true), or set no_load_optim=True to skip optimizer loading."
)
HF_RESUME_MESSAGE = (
    "Resume training (no_load_optim=False) is not supported for HuggingFace checkpoints. "
    "{dir} is a Hugging Face model directory: set checkpoint.no_load_optim: true to fine-tune from its weights."
)


def load_checkpoint(
    header: CheckpointHeader,
    target: Checkpointable,
    *,
    no_load_optim: bool,
    hf_loader: Callable[[nn.Module, Path], None] | None = None,
    partial_load: bool = False,
    reset_optimizer: bool = False,
) -> None:
    """Restore ``target`` from ``header`` (its files verified against their checksums first).

    With ``no_load_optim`` only the model weights are loaded; otherwise model, optimizer, scheduler, trainer
    counters, data position and RNG states are restored, so training continues exactly.
    ``reset_optimizer`` (``checkpoint.reset_optimizer``) resumes everything but the optimizer state, which
    starts fresh: the one way to resume with another optimizer type.
    """
    if header.kind == "hf":
        _load_hf(header, target, no_load_optim, hf_loader)
        return
    verify_checkpoint(header.path, required=header.common.get("format") != LEGACY_FORMAT)
    resume = not no_load_optim
    load_optimizer = resume and target.optimizer is not None and not reset_optimizer
    if load_optimizer and not header.has_optimizer:
        raise CheckpointError(NO_OPTIMIZER_MESSAGE.format(dir=header.path))
    metadata = _read_metadata(header.path)
    keys = metadata.state_dict_metadata
    rank = dist.get_rank() if _distributed() else 0
    model_sd, adapters_only = _model_entries(header, target, keys, hf_loader, no_load_optim, partial_load)
    # Formats of earlier lmforge versions: detected (and named in the log) here, converted after the load
    # below by train/checkpoint/compat (removed in lmforge 0.3); nothing else in this module knows them.
    from lmforge.train.checkpoint.compat import detect_older_formats

    older = detect_older_formats(header, keys, model_sd)
    sd: dict[str, Any] = {"model": model_sd}
    optimizer_format = header.common.get("optimizer_format") or "plain"
    local_param_names = None
    if load_optimizer:
        saved_type = header.common.get("optimizer_type") or older.saved_optimizer(target, optimizer_format)
        check_optimizer_type(header, target, saved_type)
        local_param_names = _allocate_optimizer(sd, metadata, target, optimizer_format)
    if resume:
        _allocate_run_state(sd, metadata, header, target, rank)

    with _quiet_single_process():
        load_dcp(sd, header.path, no_dist=not _distributed())
    if local_param_names is not None:
        # The nested form saved a group's parameter names once, from one rank; pipeline stages hold
        # different parameters, so each rank keeps its own names.
        for group, names in zip(sd["optimizer"]["param_groups"], local_param_names):
            group["params"] = names

    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(target.model, sd["model"], options=_non_strict())
    if not resume:
        older.upgrade(target, adapters_only)
        logger.info(
            "Loaded model weights from %s (no_load_optim: optimizer and step start fresh).", header.path
        )
        return
    if load_optimizer:
        _set_optimizer(sd, target, optimizer_format)
    elif target.optimizer is not None:
        logger.warning(
            "checkpoint.reset_optimizer: true: resuming %s without its optimizer state (%s); %s starts from a "
            "fresh state, everything else (weights, step, schedule, data position) continues.",
            header.path,
            header.common.get("optimizer_type") or "type not recorded",
            type(target.optimizer).__name__,
        )
    older.upgrade(target, adapters_only)
    _restore_run_state(sd, header, target, rank)
    logger.info("Resumed from %s at step %d.", header.path, target.state.global_step)


def _load_hf(
    header: CheckpointHeader,
    target: Checkpointable,
    no_load_optim: bool,
    hf_loader: Callable[[nn.Module, Path], None] | None,
) -> None:
    if not no_load_optim:
        raise CheckpointError(HF_RESUME_MESSAGE.format(dir=header.path))
    if hf_loader is None:
        raise CheckpointError(
            f"{header.path} is a Hugging Face model directory, but this model type cannot load Hugging Face "
            f"weights. Use an lmforge checkpoint (iteration_XXXXXXXX) as checkpoint.load_path."
        )
    hf_loader(target.model, header.path)
    logger.info("Loaded Hugging Face weights from %s (optimizer state starts fresh).", header.path)


def _model_entries(
    header: CheckpointHeader,
    target: Checkpointable,
    keys: Any,
    hf_loader: Callable[[nn.Module, Path], None] | None,
    no_load_optim: bool,
    partial_load: bool,
) -> tuple[dict[str, Any], bool]:
    """(the model's state dict entries to load, whether the checkpoint holds LoRA adapters only)."""
    model_sd = _model_state_dict(target.model)
    from lmforge.models.lora import is_lora_param_name

    has_adapters = any(is_lora_param_name(k) for k in model_sd)
    if not has_adapters and any(k.startswith("model.") and is_lora_param_name(k) for k in keys):
        # Loading only the base would silently drop what the fine-tuning learnt.
        raise CheckpointError(
            f"Checkpoint {header.path} holds LoRA adapters (the run had lora_config) but the model has none. "
            "Build the model with the run's lora_config (lmforge generate / eval read it from the checkpoint's "
            "config.yaml or --config), or export the merged model with 'lmforge convert --to-hf DIR --from CKPT'."
        )
    lora_base = header.common.get("lora_base")
    if lora_base and has_adapters:
        # A small LoRA checkpoint: the frozen base is rebuilt from its record, then the rest is loaded.
        from lmforge.train.checkpoint.lora import restore_base, without_frozen

        restore_base(lora_base, target.model, header.path, hf_loader)
        model_sd = without_frozen(target.model, model_sd)
    if no_load_optim:
        # Fine-tuning with LoRA from a checkpoint of the base model: the adapters keep their fresh init.
        fresh = {k for k in model_sd if f"model.{k}" not in keys and is_lora_param_name(k)}
        model_sd = {k: v for k, v in model_sd.items() if k not in fresh}
    model_sd = _matching_parameters(header.path, model_sd, keys, partial_load, no_load_optim)
    _check_shapes(header.path, model_sd, keys)
    return model_sd, bool(lora_base and has_adapters)


def _allocate_optimizer(
    sd: dict[str, Any], metadata: Any, target: Checkpointable, optimizer_format: str
) -> list[Any] | None:
    """Put the optimizer's entries to load into ``sd``; returns each group's own parameter names (nested form)."""
    if optimizer_format not in ("fqn", "fqn_flat"):
        sd["optimizer"] = _allocate_encoded(metadata, "optimizer")
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd["optimizer"] = get_optimizer_state_dict(
        target.model, target.optimizer, options=_optimizer_options(optimizer_format)
    )
    if optimizer_format == "fqn":
        return [group["params"] for group in sd["optimizer"]["param_groups"]]
    return None


def _set_optimizer(sd: dict[str, Any], target: Checkpointable, optimizer_format: str) -> None:
    if optimizer_format in ("fqn", "fqn_flat"):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(
            target.model,
            target.optimizer,
            sd["optimizer"],
            options=_optimizer_options(optimizer_format),
        )
    else:
        target.optimizer.load_state_dict(decode_state(sd["optimizer"]))


def _allocate_run_state(
    sd: dict[str, Any], metadata: Any, header: CheckpointHeader, target: Checkpointable, rank: int
) -> None:
    """Put the scheduler, trainer counters, and this rank's RNG and data position into ``sd``."""
    keys = metadata.state_dict_metadata
    if target.scheduler is not None and _has_key(keys, "scheduler"):
        sd["scheduler"] = _allocate_encoded(metadata, "scheduler")
    sd["trainer"] = _allocate_encoded(metadata, "trainer")
    own = f"rank_{rank}"
    if _has_key(keys, f"rng.{own}"):
        sd["rng"] = {own: _allocate_encoded(metadata, f"rng.{own}")}
    same_layout = int(header.common.get("world_size", 1)) == (dist.get_world_size() if _distributed() else 1)
    if target.dataloader is not None and same_layout and _has_key(keys, f"dataloader.{own}"):
        sd["dataloader"] = {own: _allocate_encoded(metadata, f"dataloader.{own}")}
    if target.callbacks is not None and _has_key(keys, f"callbacks.{own}"):
        sd["callbacks"] = {own: _allocate_encoded(metadata, f"callbacks.{own}")}


def _restore_run_state(
    sd: dict[str, Any], header: CheckpointHeader, target: Checkpointable, rank: int
) -> None:
    own = f"rank_{rank}"
    if "scheduler" in sd:
        target.scheduler.load_state_dict(decode_state(sd["scheduler"]))
    target.state.load_dict(decode_state(sd["trainer"]))
    if "rng" in sd:
        restore_rng_state(decode_state(sd["rng"][own]))
    else:
        logger.warning(
            "Checkpoint %s has no RNG state for rank %d (saved on %s ranks): random streams restart from the seed.",
            header.path,
            rank,
            header.common.get("world_size", "?"),
        )
    if "dataloader" in sd and hasattr(target.dataloader, "load_state_dict"):
        target.dataloader.load_state_dict(decode_state(sd["dataloader"][own]))
    if target.callbacks is not None:
        # A rank the checkpoint has no callback state for (a run saved on fewer ranks): {} lets the
        # handler name every stateful callback that starts fresh.
        saved = decode_state(sd["callbacks"][own]) if "callbacks" in sd else {}
        target.callbacks.load_state_dict(saved, where=str(header.path))


def check_optimizer_type(header: CheckpointHeader, target: Checkpointable, saved: str | None) -> None:
    """Refuse to resume one optimizer's state into another (Lion would silently reuse AdamW's moments).

    ``saved``: the type recorded in ``common.json`` (or, for a checkpoint from before that record, what
    ``compat`` tells from its state names); None when unknown.
    """
    current = type(target.optimizer).__name__
    if saved is None or saved == current:
        return
    raise CheckpointError(
        f"Checkpoint {header.path} holds the state of {saved} ({header.path / COMMON_FILE}), but this run's "
        f"optimizer is {current}: its state cannot be resumed into another optimizer type. Set "
        "checkpoint.reset_optimizer: true to resume with a fresh optimizer state (weights, step, schedule and data "
        "position continue), checkpoint.no_load_optim: true to start a new run from the weights only, or use the "
        "optimizer.type the checkpoint was trained with."
    )


def load_model_weights(path: str | os.PathLike, model: nn.Module) -> CheckpointHeader:
    """Load only the model weights of a checkpoint (for generation and evaluation)."""
    header = resolve_checkpoint(path)
    if header is None:
        raise CheckpointError(f"No checkpoint found at {path}: the directory is missing or empty.")
    if header.kind == "hf":
        raise CheckpointError(f"{header.path} is a Hugging Face model directory, not an lmforge checkpoint.")
    load_checkpoint(header, Checkpointable(model=model), no_load_optim=True)
    return header


def _matching_parameters(
    path: Path, model_sd: dict[str, Any], keys: Any, partial_load: bool, no_load_optim: bool
) -> dict[str, Any]:
    """The model's parameters to load; a checkpoint with other parameters is refused unless
    ``checkpoint.partial_load`` says to load the common ones (and the others are listed)."""
    missing = [k for k in model_sd if f"model.{k}" not in keys]
    # Under pipeline parallelism a rank holds only its stage's layers: a checkpoint parameter is
    # unexpected only if no rank's model has it (a collective: every rank loads).
    known: set[str] = set(model_sd)
    if _distributed():
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(model_sd))
        known = {n for rank_names in names for n in rank_names}
    unexpected = sorted(
        k[len("model.") :] for k in keys if k.startswith("model.") and k[len("model.") :] not in known
    )
    if not missing and not unexpected:
        return model_sd
    if not partial_load:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} parameter(s) of the model are missing from it, e.g. {', '.join(missing[:5])}"
            )
        if unexpected:
            parts.append(
                f"it holds {len(unexpected)} parameter(s) the model does not have, e.g. {', '.join(unexpected[:5])}"
            )
        raise CheckpointError(
            f"Checkpoint {path} does not match the model: {'; '.join(parts)}. Check that the model section is the "
            "one the checkpoint was trained with (e.g. num_hidden_layers), or set checkpoint.partial_load: true "
            "(with no_load_optim: true) to load only the parameters both have."
        )
    if not no_load_optim:
        raise CheckpointError(
            "checkpoint.partial_load: true loads model weights only; set checkpoint.no_load_optim: true as well "
            "(the optimizer state of a different set of parameters cannot be resumed)."
        )
    logger.warning(
        "checkpoint.partial_load: loading %d of the model's %d parameters from %s. Not in the checkpoint (keep "
        "their initial values): %s. In the checkpoint but not in the model (skipped): %s.",
        len(model_sd) - len(missing),
        len(model_sd),
        path,
        ", ".join(missing) or "none",
        ", ".join(unexpected) or "none",
    )
    return {k: v for k, v in model_sd.items() if k not in missing}


def _check_shapes(path: Path, model_sd: dict[str, Any], keys: dict[str, Any]) -> None:
    bad = []
    for name, tensor in model_sd.items():
        meta = keys[f"model.{name}"]
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            bad.append(f"{name}: checkpoint {tuple(meta.size)} vs model {tuple(tensor.shape)}")
    if bad:
        raise CheckpointError(
            f"Checkpoint {path} does not match the model's shapes ({len(bad)} parameter(s)): {'; '.join(bad[:3])}. "
            f"Check that the model section is the one the checkpoint was trained with."
        )
