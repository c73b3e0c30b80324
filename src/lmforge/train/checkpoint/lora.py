"""Small LoRA checkpoints: the adapters (and their optimizer state) plus a record of the frozen base.

A run with ``lora_config`` saves in each ``iteration_XXXXXXXX/`` only what training changes: the
trainable (adapter) parameters, the model's buffers (e.g. MoE ``expert_bias``, which moves while the
base is frozen) and the optimizer state of the adapters. ``common.json`` gets ``lora_base``, where the
frozen base came from, so that a resume (``load_path``, ``auto_resume``, elastic restarts), ``lmforge
generate`` / ``eval`` and ``lmforge convert --to-hf`` rebuild the base first and then load the adapters:

- ``{"kind": "init", "seed": S}``: a fresh init; the layout-invariant init gives the same base from ``S``
  on every layout.
- ``{"kind": "hf" | "dcp", "path": ABS_DIR, "files": {NAME: RECORD}}``: a Hugging Face directory or an
  lmforge checkpoint loaded through ``checkpoint.load_path``. Every weight file is recorded at the start
  of the run and checked before the base is rebuilt, so a moved, deleted or rewritten base is a clear
  error rather than adapters applied to other weights.

A RECORD is the one of ``checksums.json`` (``verify.py``): ``{"size": N, "sha256": H}`` for a file of at
most one block (128 MiB), ``{"size": N, "block_size": B, "blocks": [H, ...]}`` above, so that a large
base is checked on several threads rather than one stream of SHA-256 (records of lmforge before block
records are all of the first form, and are checked as before). The check runs on rank 0 only, each
time such a checkpoint is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint.verify import all_blocks, check_blocks, entry_problem, read_record, record_files
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint.lora")

LORA_BASE_KEY = "lora_base"  # in common.json
_HF_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "config.json")
_DCP_FILE_PATTERNS = (".metadata", "*.distcp")


def has_adapters(model: nn.Module) -> bool:
    from lmforge.models.lora import lora_modules

    return bool(lora_modules(model))


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """State-dict names of the parameters training does not change (the frozen base)."""
    from lmforge.train.checkpoint import _canonical_name

    return {_canonical_name(n) for n, p in model.named_parameters() if not p.requires_grad}


def without_frozen(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """``model_sd`` less the frozen base parameters (adapters and buffers stay)."""
    frozen = frozen_parameter_names(model)
    return {k: v for k, v in model_sd.items() if k not in frozen}


def _weight_files(path: Path, kind: str) -> list[Path]:
    patterns = _HF_FILE_PATTERNS if kind == "hf" else _DCP_FILE_PATTERNS
    return sorted({f for pattern in patterns for f in path.glob(pattern) if f.is_file()})


def fingerprint(path: Path, kind: str, block_size: int | None = None) -> dict[str, dict[str, Any]]:
    """The record of each weight file of a base directory (read once, several files at a time)."""
    return record_files(_weight_files(path, kind), block_size)


def _checkpoint_records(path: Path) -> dict[str, dict[str, Any]] | None:
    """The records an lmforge checkpoint holds of its own weight files, or None when it lacks one of them
    (a checkpoint of ``lmforge-dcp/1`` has none)."""
    files, problem = read_record(path, required=False)
    if files is None or problem is not None:
        return None
    names = [f.name for f in _weight_files(path, "dcp")]
    if not names or any(name not in files for name in names):
        return None
    return {name: dict(files[name]) for name in names}


def base_record(header: Any, seed: int) -> dict[str, Any]:
    """Where the frozen base of this run comes from, given what ``checkpoint.load_path`` resolved to and
    ``load_checkpoint`` has just loaded into the model."""
    if header is None:
        return {"kind": "init", "seed": int(seed)}
    recorded = header.common.get(LORA_BASE_KEY) if header.kind == "dcp" else None
    if recorded:
        return dict(recorded)  # resumed (or fine-tuned further) from a small checkpoint: the same base
    path = Path(header.path).resolve()
    # An lmforge checkpoint's own checksums.json is taken rather than hashing the base again: the load
    # that put these weights into the model (every rank, before reading anything) has just checked every
    # file against that record and refused the checkpoint otherwise, so the record is what was loaded; a
    # hash taken now would be a second read of the whole base on rank 0 alone, and would describe the
    # files as they are now rather than as they were loaded.
    files = _checkpoint_records(path) if header.kind == "dcp" else None
    if files is None:
        files = fingerprint(path, header.kind)
    return {"kind": header.kind, "path": str(path), "files": files}


def _recorded_files(record: dict[str, Any], checkpoint: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` of a base record, each entry one ``checksums.json`` could hold (or refused)."""
    files = record.get("files") or {}
    problems = [] if isinstance(files, dict) else ["its files is not an object"]
    if not problems:
        problems = [f"the entry of {n!r} {p}" for n, e in sorted(files.items()) if (p := entry_problem(e))]
    if problems:
        raise CheckpointError(
            f"{checkpoint}/common.json: lora_base of kind {record['kind']!r} is not a record lmforge writes: "
            f'{problems[0]}. Each file is recorded as {{"size": N, "sha256": HEX}} or {{"size": N, '
            '"block_size": B, "blocks": [HEX, ...]}; the checkpoint is corrupt.'
        )
    return files


def check_base(record: dict[str, Any], checkpoint: Path, *, verified_by_load: bool = False) -> None:
    """Refuse a recorded base that is missing or no longer the one the adapters were trained on.

    ``verified_by_load``: the caller loads an lmforge base right after, and that load checks every byte
    against the base's own ``checksums.json`` (``verify_checkpoint``, on every rank). When that record is
    still exactly the recorded one, the base is the same one unless its bytes were damaged, which the load
    refuses; hashing it here as well would read the whole base twice."""
    kind = record.get("kind")
    if kind == "init":
        if not isinstance(record.get("seed"), int):
            raise CheckpointError(f"{checkpoint}/common.json: lora_base of kind 'init' has no integer seed.")
        return
    if kind not in ("hf", "dcp") or not isinstance(record.get("path"), str):
        raise CheckpointError(
            f"{checkpoint}/common.json: lora_base {record!r} is not a record lmforge writes (kind 'init', 'hf' "
            "or 'dcp' with a path); the checkpoint is corrupt."
        )
    path = Path(record["path"])
    what = "Hugging Face directory" if kind == "hf" else "lmforge checkpoint"
    how = (
        f"The LoRA checkpoint {checkpoint} holds only the adapters; its frozen base is the {what} {path}, "
        "read when the run started (checkpoint.load_path)."
    )
    if not path.is_dir():
        raise CheckpointError(
            f"{how} That directory no longer exists. Put the base back at that path, or export the adapters "
            "from a copy of the run that still has it."
        )
    expected = _recorded_files(record, checkpoint)
    if verified_by_load and kind == "dcp" and _checkpoint_records(path) == expected:
        return
    on_disk = {f.name for f in _weight_files(path, kind)}
    changed = set(expected) ^ on_disk  # added or removed
    present = {name: want for name, want in expected.items() if name in on_disk}
    # Sizes first (a file of another size is not read), then the blocks of all files on several threads.
    checks = check_blocks(path, present, all_blocks(present))
    changed = sorted(changed | {check.name for check in checks if not check.ok})
    if changed:
        raise CheckpointError(
            f"{how} Its weight files changed since (size or SHA-256 differ, or files were added/removed: "
            f"{', '.join(changed[:5])}), so the adapters would be applied to other weights. Restore the original "
            "base files at that path."
        )


def _check_base_once(record: dict[str, Any], checkpoint: Path) -> None:
    """:func:`check_base` on rank 0 only (hashing a large base is slow), its verdict raised on every rank;
    for the base that :func:`restore_base` loads next (an lmforge one is verified by that load)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        check_base(record, checkpoint, verified_by_load=True)
        return
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            check_base(record, checkpoint, verified_by_load=True)
        except CheckpointError as exc:
            verdict[0] = str(exc)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


@torch.no_grad()
def restore_base(
    record: dict[str, Any],
    model: nn.Module,
    checkpoint: Path,
    hf_loader: Callable[[nn.Module, Path], None] | None,
) -> None:
    """Rebuild the frozen base of ``model`` from ``record`` (checked first)."""
    _check_base_once(record, checkpoint)
    kind = record["kind"]
    if kind == "init":
        model.init_weights(int(record["seed"]))  # adapters are left alone (not nn.Linear) and loaded next
        logger.info("LoRA checkpoint: base re-initialised from seed %d.", record["seed"])
        return
    path = Path(record["path"])
    if kind == "hf":
        if hf_loader is None:
            from lmforge.models import load_hf_weights as hf_loader
        hf_loader(model, path)
    else:
        from lmforge.train.checkpoint import Checkpointable, load_checkpoint, resolve_checkpoint

        header = resolve_checkpoint(path)
        if header is None or header.kind != "dcp":
            raise CheckpointError(
                f"The LoRA base {path} (recorded in {checkpoint}) is not an lmforge checkpoint."
            )
        load_checkpoint(header, Checkpointable(model=model), no_load_optim=True, hf_loader=hf_loader)
    logger.info("LoRA checkpoint: base weights rebuilt from %s (checked: sizes and SHA-256).", path)
