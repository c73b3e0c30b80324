"""``lmforge convert``: Hugging Face model directory ↔ lmforge checkpoint.

* ``--from-hf DIR --to CKPT_DIR``: writes an lmforge checkpoint the trainer resumes from or fine-tunes
  (``checkpoint.load_path: CKPT_DIR`` with ``no_load_optim: true``): ``CKPT_DIR/iteration_00000000/``
  in the trainer's DCP layout, model weights only, with ``config.yaml`` holding the ``model`` section.
  ``--format safetensors`` writes the model-only form instead (``model.safetensors`` +
  ``lmforge_model.json``, see ``lmforge.models.io``).
* ``--to-hf DIR --from CKPT_DIR``: reads either form (a DCP save_path or iteration directory, whose
  ``config.yaml`` has the model section, or ``--config train.yaml`` to give it) and writes
  ``config.json`` + ``model.safetensors`` that transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lmforge.errors import CheckpointError, ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert weights between a Hugging Face model directory and an lmforge checkpoint",
        description=(
            "Convert model weights: --from-hf DIR --to CKPT_DIR imports a Hugging Face model (config.json + "
            "safetensors); --to-hf DIR --from CKPT_DIR exports an lmforge checkpoint for transformers."
        ),
    )
    parser.add_argument("--from-hf", metavar="DIR", help="Hugging Face model directory to import")
    parser.add_argument("--to", metavar="CKPT_DIR", help="lmforge checkpoint directory to write")
    parser.add_argument("--to-hf", metavar="DIR", help="Hugging Face model directory to write")
    parser.add_argument("--from", dest="from_ckpt", metavar="CKPT_DIR", help="lmforge checkpoint to export")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="train.yaml whose model section describes --from (when the checkpoint has no config.yaml)",
    )
    parser.add_argument(
        "--format",
        choices=("dcp", "safetensors"),
        default="dcp",
        help="form of the lmforge checkpoint written by --to (default: dcp, the trainer's layout)",
    )
    parser.add_argument("--dtype", help="dtype of the imported weights (default: the checkpoint's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    importing = bool(args.from_hf or args.to)
    exporting = bool(args.to_hf or args.from_ckpt)
    if (
        importing == exporting
        or (importing and not (args.from_hf and args.to))
        or (exporting and not (args.to_hf and args.from_ckpt))
    ):
        raise ConfigError(
            "lmforge convert needs exactly one direction: --from-hf DIR --to CKPT_DIR, or --to-hf DIR --from CKPT_DIR."
        )
    if importing:
        return _import_hf(Path(args.from_hf), Path(args.to), args.format, args.dtype)
    return _export_hf(Path(args.from_ckpt), Path(args.to_hf), args.config)


# What a directory written by an earlier conversion of the same kind holds; only such a directory
# (or an empty one) is replaced. Anything else, a training run's save_path above all, is refused.
_OWN_OUTPUT = {
    "dcp": {"latest_checkpointed_iteration.txt", "iteration_00000000"},
    "safetensors": {"model.safetensors", "lmforge_model.json"},
    "hf": {"config.json", "model.safetensors"},
}


def _check_destination(dst: Path, option: str, kind: str) -> None:
    """Refuse a destination whose contents this conversion would destroy (before any work)."""
    from lmforge.train.checkpoint import TRACKER_FILE, read_tracker
    from lmforge.utils.atomic import check_output_dir

    check_output_dir(dst, option)
    if not dst.is_dir():
        return
    names = {p.name for p in dst.iterdir()}
    if TRACKER_FILE in names and (kind != "dcp" or read_tracker(dst) != 0 or not names <= _OWN_OUTPUT["dcp"]):
        raise CheckpointError(
            f"{option} {str(dst)!r} is a training run's checkpoint directory (its {TRACKER_FILE} names iteration "
            f"{read_tracker(dst)}); converting into it would replace that tracker and the run could no longer "
            f"resume. Choose a new directory for {option}."
        )
    if names and not names <= _OWN_OUTPUT[kind]:
        shown = ", ".join(sorted(names)[:5])
        raise CheckpointError(
            f"{option} {str(dst)!r} already holds other files ({shown}); lmforge convert replaces only an empty "
            f"directory or the output of an earlier conversion of the same kind. Choose a new directory."
        )


def _import_hf(src: Path, dst: Path, form: str, dtype: str | None) -> int:
    from lmforge.models import load_hf_pretrained, save_model_checkpoint
    from lmforge.utils.atomic import atomic_dir

    _check_destination(dst, "--to", form)
    model = load_hf_pretrained(src, dtype=dtype)
    # Written aside and renamed into place: a failure leaves what was at --to untouched.
    with atomic_dir(dst) as tmp:
        if form == "safetensors":
            save_model_checkpoint(model, tmp)
        else:
            from lmforge.train.checkpoint import Checkpointable, CheckpointManager

            manager = CheckpointManager(
                tmp, no_save_optim=True, save_max=0, config_dict={"model": model.config.section}
            )
            if not manager.save(Checkpointable(model=model), step=0):
                raise CheckpointError(f"{src} holds non-finite weights; nothing was written to {dst}.")
            manager.close()
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} ({model.config.model_type}, {n:,} parameters) -> {dst}")
    return 0


def _model_section_for(ckpt: Path, config: str | None) -> dict:
    import yaml

    from lmforge.train.checkpoint import CONFIG_FILE, resolve_checkpoint

    if config:
        from lmforge.config import read_raw

        raw, _ = read_raw(config)
        section = raw.get("model")
        if not isinstance(section, dict):
            raise ConfigError(f"{config} has no model section.")
        return section
    header = resolve_checkpoint(ckpt)
    if header is None or header.kind != "dcp":
        raise CheckpointError(
            f"{ckpt} is not an lmforge checkpoint (expected a save_path or iteration directory)."
        )
    cfg_file = header.path / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{header.path} has no {CONFIG_FILE}; give the run's train.yaml with --config.")
    section = (yaml.safe_load(cfg_file.read_text()) or {}).get("model")
    if not isinstance(section, dict):
        raise CheckpointError(f"{cfg_file} has no model section; give the run's train.yaml with --config.")
    return section


def _export_hf(src: Path, dst: Path, config: str | None) -> int:
    from lmforge.models import build_model, load_model_checkpoint, save_hf_pretrained
    from lmforge.models.io import SECTION_FILE
    from lmforge.utils.atomic import atomic_dir

    _check_destination(dst, "--to-hf", "hf")
    if (src / SECTION_FILE).is_file():
        model = load_model_checkpoint(src)
    else:
        from lmforge.train.checkpoint import load_model_weights

        model = build_model(_model_section_for(src, config), device="meta")
        model.to_empty(device="cpu")
        model.init_weights()
        load_model_weights(src, model)
    with atomic_dir(dst) as tmp:
        save_hf_pretrained(model, tmp)
    print(f"converted {src} ({model.config.model_type}) -> {dst}")
    return 0
