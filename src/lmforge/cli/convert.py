"""``lmforge convert``: Hugging Face model directory ↔ lmforge checkpoint.

* ``--from-hf DIR --to CKPT_DIR``: writes an lmforge checkpoint the trainer resumes from or fine-tunes
  (``checkpoint.load_path: CKPT_DIR`` with ``no_load_optim: true``): ``CKPT_DIR/iteration_00000000/``
  in the trainer's DCP layout, model weights only, with ``config.yaml`` holding the ``model`` section.
  ``--format safetensors`` writes the model-only form instead (``model.safetensors`` +
  ``lmforge_model.json``, see ``lmforge.models.io``).
* ``--to-hf DIR --from CKPT_DIR``: reads either form (a DCP save_path or iteration directory, whose
  ``config.yaml`` has the model section, or ``--config train.yaml`` to give it) and writes
  ``config.json`` + ``model.safetensors`` that transformers' ``from_pretrained`` loads. A LoRA run
  (``lora_config`` in that config) is written merged; with ``--peft ADAPTER_DIR`` DIR gets the base
  model and ADAPTER_DIR the adapters in the PEFT format.
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
    parser.add_argument(
        "--peft",
        metavar="ADAPTER_DIR",
        help="for a LoRA checkpoint (lora_config): write the base model to --to-hf and the adapters to "
        "ADAPTER_DIR in the PEFT format (default without it: --to-hf gets the merged model)",
    )
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
        if args.peft:
            raise ConfigError(
                "lmforge convert --peft goes with --to-hf DIR --from CKPT_DIR (exporting a LoRA run)."
            )
        return _import_hf(Path(args.from_hf), Path(args.to), args.format, args.dtype)
    return _export_hf(Path(args.from_ckpt), Path(args.to_hf), args.config, args.peft)


def _import_hf(src: Path, dst: Path, form: str, dtype: str | None) -> int:
    from lmforge.models import load_hf_pretrained, save_model_checkpoint

    model = load_hf_pretrained(src, dtype=dtype)
    if form == "safetensors":
        save_model_checkpoint(model, dst)
    else:
        from lmforge.train.checkpoint import Checkpointable, CheckpointManager

        manager = CheckpointManager(
            dst, no_save_optim=True, save_max=0, config_dict={"model": model.config.section}
        )
        if not manager.save(Checkpointable(model=model), step=0):
            raise CheckpointError(f"{src} holds non-finite weights; nothing was written to {dst}.")
        manager.close()
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} ({model.config.model_type}, {n:,} parameters) -> {dst}")
    return 0


def _model_section_for(ckpt: Path, config: str | None, key: str = "model") -> dict | None:
    """The ``model`` section (required) or another section (``lora_config``; None when absent) of the run."""
    import yaml

    from lmforge.train.checkpoint import CONFIG_FILE, resolve_checkpoint

    if config:
        from lmforge.config import read_raw

        raw, _ = read_raw(config)
        section = raw.get(key)
        if key != "model":
            return section if isinstance(section, dict) else None
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
    section = (yaml.safe_load(cfg_file.read_text()) or {}).get(key)
    if key != "model":
        return section if isinstance(section, dict) else None
    if not isinstance(section, dict):
        raise CheckpointError(f"{cfg_file} has no model section; give the run's train.yaml with --config.")
    return section


def _export_hf(src: Path, dst: Path, config: str | None, peft_dir: str | None = None) -> int:
    from lmforge.models import build_model, load_model_checkpoint, save_hf_pretrained
    from lmforge.models.io import SECTION_FILE

    lora = None
    if (src / SECTION_FILE).is_file():
        model = load_model_checkpoint(src)
    else:
        from lmforge.train.checkpoint import load_model_weights

        model = build_model(_model_section_for(src, config), device="meta")
        lora = _model_section_for(src, config, "lora_config")
        if lora is not None:
            from lmforge.models.lora import apply_lora

            apply_lora(model, lora)  # so that the checkpoint's adapters are read, not dropped
        model.to_empty(device="cpu")
        model.init_weights()
        load_model_weights(src, model)
    if peft_dir and lora is None:
        raise ConfigError(
            f"--peft: {src} was not trained with lora_config, so it has no adapters to write; drop --peft."
        )
    if lora is not None:
        from lmforge.models.lora import merge_lora

        if peft_dir:
            from lmforge.models.lora_export import save_peft_adapter

            save_peft_adapter(model, peft_dir, dst)
            for m in _lora_modules(model):
                m.lora_B.weight.data.zero_()  # the base alone goes to --to-hf
        merge_lora(model)
    save_hf_pretrained(model, dst)
    what = "base model" if peft_dir else ("merged LoRA model" if lora is not None else "model")
    print(f"converted {src} ({model.config.model_type}, {what}) -> {dst}")
    if peft_dir:
        print(f"PEFT LoRA adapter -> {peft_dir}")
    return 0


def _lora_modules(model: Any) -> list[Any]:
    from lmforge.models.lora import lora_modules

    return list(lora_modules(model).values())
