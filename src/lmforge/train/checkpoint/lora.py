"""Small LoRA checkpoints: the adapters (and their optimizer state) plus a record of the frozen base.

A run with ``lora_config`` saves in each ``iteration_XXXXXXXX/`` only what training changes: the
trainable (adapter) parameters, the model's buffers (e.g. MoE ``expert_bias``, which moves while the
base is frozen) and the optimizer state of the adapters. ``common.json`` gets ``lora_base``, where the
frozen base came from, so that a resume (``load_path``, ``auto_resume``, elastic restarts), ``lmforge
generate`` / ``eval`` and ``lmforge convert --to-hf`` rebuild the base first and then load the adapters:

- ``{"kind": "init", "seed": S}``: a fresh init; the layout-invariant init gives the same base from ``S``
  on every layout.
- ``{"kind": "hf" | "dcp", "path": ABS_DIR, "files": {NAME: {"size": N, "sha256": H}}}``: a Hugging Face
  directory or an lmforge checkpoint loaded through ``checkpoint.load_path``. Every weight file's size
  and SHA-256 are recorded at the start of the run and checked before the base is rebuilt, so a moved,
  deleted or rewritten base is a clear error rather than adapters applied to other weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.errors import CheckpointError
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


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path: Path, kind: str) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each weight file of a base directory (read once per run)."""
    return {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)} for f in _weight_files(path, kind)}


def base_record(header: Any, seed: int) -> dict[str, Any]:
    """Where the frozen base of this run comes from, given what ``checkpoint.load_path`` resolved to."""
    if header is None:
        return {"kind": "init", "seed": int(seed)}
    recorded = header.common.get(LORA_BASE_KEY) if header.kind == "dcp" else None
    if recorded:
        return dict(recorded)  # resumed (or fine-tuned further) from a small checkpoint: the same base
    path = Path(header.path).resolve()
    return {"kind": header.kind, "path": str(path), "files": fingerprint(path, header.kind)}


def check_base(record: dict[str, Any], checkpoint: Path) -> None:
    """Refuse a recorded base that is missing or no longer the one the adapters were trained on."""
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
    expected: dict[str, Any] = record.get("files") or {}
    actual_files = {f.name: f for f in _weight_files(path, kind)}
    changed = sorted(set(expected) ^ set(actual_files))
    for name, want in sorted(expected.items()):
        f = actual_files.get(name)
        if f is None or name in changed:
            continue
        if f.stat().st_size != want.get("size") or _sha256(f) != want.get("sha256"):
            changed.append(name)
    if changed:
        raise CheckpointError(
            f"{how} Its weight files changed since (size or SHA-256 differ, or files were added/removed: "
            f"{', '.join(changed[:5])}), so the adapters would be applied to other weights. Restore the original "
            "base files at that path."
        )


def _check_base_once(record: dict[str, Any], checkpoint: Path) -> None:
    """:func:`check_base` on rank 0 only (hashing a large base is slow), its verdict raised on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        check_base(record, checkpoint)
        return
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            check_base(record, checkpoint)
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
