"""``lmforge convert``: Hugging Face model directory ↔ lmforge checkpoint.

* ``--from-hf DIR --to CKPT_DIR``: writes an lmforge checkpoint the trainer resumes from or fine-tunes
  (``checkpoint.load_path: CKPT_DIR`` with ``no_load_optim: true``): ``CKPT_DIR/iteration_00000000/``
  in the trainer's DCP layout, model weights only, with ``config.yaml`` holding the ``model`` section.
  ``--format safetensors`` writes the model-only form instead (``model.safetensors`` +
  ``lmforge_model.json``, see ``lmforge.models.io``).
* ``--to-hf DIR --from CKPT_DIR``: reads either form (a DCP save_path or iteration directory, whose
  ``config.yaml`` has the model section, or ``--config train.yaml`` to give it) and writes a directory
  transformers' ``from_pretrained`` loads: ``config.json`` (rope settings in both the 4.x and 5.x
  forms), ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (``--max-shard-size``,
  default 5GB), and the tokenizer files + ``generation_config.json``. The tokenizer is ``--tokenizer``,
  else the ``tokenizer.json`` saved with the checkpoint, else the one of the run's data
  (``--no-tokenizer`` exports weights only); ``--chat-template FILE`` sets its chat template.
  A LoRA run (``lora_config`` in that config) is written merged; with ``--peft ADAPTER_DIR`` DIR gets
  the base model and ADAPTER_DIR the adapters in the PEFT format.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lmforge.errors import CheckpointError, ConfigError
from lmforge.utils.pids import pid_alive


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
        default=None,
        help="form of the lmforge checkpoint written by --to (default: dcp, the trainer's layout)",
    )
    parser.add_argument(
        "--dtype",
        help="--from-hf: the imported model's compute_dtype (default: config.json's dtype); --to-hf: the dtype "
        "the weights are written in, cast from the checkpoint's fp32 master weights (default: the run's "
        "model.compute_dtype). float32, bfloat16 or float16",
    )
    export = parser.add_argument_group("export (--to-hf)")
    export.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="largest safetensors file written (e.g. 5GB, 500MB, 2GiB; default 5GB)",
    )
    export.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json or a directory with one (default: the checkpoint's, else the run data's)",
    )
    export.add_argument("--no-tokenizer", action="store_true", help="export the weights without a tokenizer")
    export.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template written into tokenizer_config.json and chat_template.jinja (default: the "
        "run's train_dataset.dataloader.chat_template, else the tokenizer's own)",
    )
    export.add_argument(
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
    _refuse_flags_of_the_other_direction(args, importing)
    if importing:
        return _import_hf(Path(args.from_hf), Path(args.to), args.format or "dcp", args.dtype)
    if args.max_shard_size is None:
        args.max_shard_size = DEFAULT_MAX_SHARD_SIZE
    return _export_hf(Path(args.from_ckpt), Path(args.to_hf), args)


DEFAULT_MAX_SHARD_SIZE = "5GB"
# Flags that only one direction reads, with what they do there: given with the other direction they
# would be silently ignored, so they are refused instead.
_EXPORT_ONLY = {
    "max_shard_size": "--max-shard-size",
    "tokenizer": "--tokenizer",
    "no_tokenizer": "--no-tokenizer",
    "chat_template": "--chat-template",
    "peft": "--peft",
    "config": "--config",
}


def _refuse_flags_of_the_other_direction(args: argparse.Namespace, importing: bool) -> None:
    if importing:
        given = [flag for attr, flag in _EXPORT_ONLY.items() if getattr(args, attr)]
        if given:
            raise ConfigError(
                f"lmforge convert {', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to an export (--to-hf DIR --from CKPT_DIR); an "
                "import (--from-hf DIR --to CKPT_DIR) takes the model, the tokenizer and the chat template from "
                "the Hugging Face directory. Drop it, or export instead."
            )
    elif args.format is not None:
        raise ConfigError(
            "lmforge convert --format chooses the lmforge checkpoint written by an import (--from-hf DIR --to "
            "CKPT_DIR); an export (--to-hf) always writes a Hugging Face directory, and --from reads either "
            "form. Drop --format."
        )
    if args.no_tokenizer and args.tokenizer:
        raise ConfigError(
            "lmforge convert: --tokenizer names the tokenizer to export and --no-tokenizer exports none; give "
            "one of them."
        )


# What a directory written by an earlier conversion of the same kind holds (fnmatch patterns); only
# such a directory (or an empty one) is replaced. Anything else, a training run's save_path above
# all, is refused.
_TOKENIZER_SIDE = ("tokenizer*", "special_tokens_map.json", "generation_config.json", "chat_template.*")
_OWN_OUTPUT = {
    "dcp": ("latest_checkpointed_iteration.txt", "iteration_00000000"),
    "safetensors": ("model.safetensors", "lmforge_model.json", *_TOKENIZER_SIDE),
    "hf": ("config.json", "*.safetensors", "model.safetensors.index.json", *_TOKENIZER_SIDE),
}


def recover_publish(dst: Path) -> None:
    """Finish what a conversion killed while publishing left behind (see ``atomic_dir``): the earlier
    version, moved aside to ``.NAME.old`` just before the new one was renamed in, goes back to its
    place; the temporary directories of conversions that are no longer running are removed."""
    import shutil

    from lmforge.utils.atomic import recover_dir

    if recover_dir(dst):
        print(f"restored {dst} from {dst.name}.old (an earlier conversion was interrupted while publishing)")
    prefix = f".{dst.name}.tmp-"
    siblings = dst.parent.glob(f"{prefix}*") if dst.parent.is_dir() else ()
    for tmp in siblings:
        pid = tmp.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _check_destination(dst: Path, option: str, kind: str) -> None:
    """Refuse a destination whose contents this conversion would destroy (before any work)."""
    from fnmatch import fnmatch

    from lmforge.train.checkpoint import TRACKER_FILE, read_tracker
    from lmforge.utils.atomic import check_output_dir

    check_output_dir(dst, option)
    recover_publish(dst)
    if not dst.is_dir():
        return
    names = {p.name for p in dst.iterdir()}
    foreign = sorted(n for n in names if not any(fnmatch(n, pattern) for pattern in _OWN_OUTPUT[kind]))
    if TRACKER_FILE in names and (kind != "dcp" or read_tracker(dst) != 0 or foreign):
        raise CheckpointError(
            f"{option} {str(dst)!r} is a training run's checkpoint directory (its {TRACKER_FILE} names iteration "
            f"{read_tracker(dst)}); converting into it would replace that tracker and the run could no longer "
            f"resume. Choose a new directory for {option}."
        )
    if foreign:
        raise CheckpointError(
            f"{option} {str(dst)!r} already holds other files ({', '.join(foreign[:5])}); lmforge convert replaces "
            "only an empty directory or the output of an earlier conversion of the same kind. Choose a new directory."
        )


def _import_hf(src: Path, dst: Path, form: str, dtype: str | None) -> int:
    from lmforge.models import load_hf_pretrained, save_model_checkpoint
    from lmforge.models.common.dtypes import dtype_name, parse_dtype
    from lmforge.models.hf_io import hf_compute_dtype
    from lmforge.utils.atomic import atomic_dir

    _check_destination(dst, "--to", form)
    recover_publish(src)
    compute = dtype_name(parse_dtype(dtype, "--dtype")) if dtype else None
    # The weights are kept as the directory holds them (read in float32: the master weights a run
    # starts from); --dtype, else config.json's dtype, is the model's compute_dtype.
    model = load_hf_pretrained(src, dtype="float32")
    section = {**model.config.section, "compute_dtype": compute or hf_compute_dtype(src)}
    # Written aside and renamed into place: a failure leaves what was at --to untouched.
    with atomic_dir(dst) as tmp:
        if form == "safetensors":
            save_model_checkpoint(model, tmp, section=section)
        else:
            from lmforge.train.checkpoint import Checkpointable, CheckpointManager

            manager = CheckpointManager(tmp, no_save_optim=True, save_max=0, config_dict={"model": section})
            if not manager.save(Checkpointable(model=model), step=0):
                raise CheckpointError(f"{src} holds non-finite weights; nothing was written to {dst}.")
            manager.close()
        _copy_tokenizer_files(src, tmp if form == "safetensors" else tmp / "iteration_00000000")
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} ({model.config.model_type}, {n:,} parameters) -> {dst}")
    return 0


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Keep the Hugging Face tokenizer with the converted weights (generate and --to-hf find it there)."""
    import shutil

    from lmforge.models.hf_tokenizer_files import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (src / name).is_file() and dst.is_dir():
            shutil.copyfile(src / name, dst / name)


def model_section_for(ckpt: Path, config: str | None, key: str = "model") -> dict | None:
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
    header = resolve_checkpoint(ckpt, "--from")
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


def _export_hf(src: Path, dst: Path, args: argparse.Namespace) -> int:
    from lmforge.models import save_hf_pretrained
    from lmforge.models.common.dtypes import dtype_name, parse_dtype
    from lmforge.models.hf_shards import parse_size
    from lmforge.utils.atomic import atomic_dir

    parse_size(args.max_shard_size)  # a bad size is refused before anything is loaded
    export_dtype = parse_dtype(args.dtype, "--dtype") if args.dtype else None
    _check_destination(dst, "--to-hf", "hf")
    recover_publish(src)
    if not src.is_dir():
        raise CheckpointError(f"--from {src}: no such checkpoint directory.")
    chat_template = None
    if args.chat_template:
        if args.no_tokenizer:
            raise ConfigError(
                "--chat-template goes into the tokenizer files; it cannot go with --no-tokenizer."
            )
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {args.chat_template}: cannot read it ({exc}).") from None
        _check_template(chat_template, args.chat_template)
    tokenizer = None if args.no_tokenizer else _tokenizer_for(src, args)  # found before any loading
    if chat_template is None and tokenizer is not None:
        chat_template = _run_chat_template(src, args.config)  # the template the run trained with
    model, lora, out_dtype = _load_for_export(src, args.config, export_dtype)
    if args.peft and lora is None:
        raise ConfigError(
            f"--peft: {src} was not trained with lora_config, so it has no adapters to write; drop --peft."
        )
    if lora is not None:
        from lmforge.models.lora import lora_modules, merge_lora

        if args.peft:
            from lmforge.models.lora_export import save_peft_adapter

            save_peft_adapter(model, args.peft, dst)
            for m in lora_modules(model).values():
                m.lora_B.weight.data.zero_()  # the base alone goes to --to-hf
        merge_lora(model)
    with atomic_dir(dst) as tmp:  # a failure leaves what was at --to-hf untouched
        files = save_hf_pretrained(
            model,
            tmp,
            tokenizer=tokenizer,
            chat_template=chat_template,
            max_shard_size=args.max_shard_size,
            dtype=out_dtype,
        )
    what = f"{len(files)} safetensors file(s) in {dtype_name(out_dtype)}" + (
        f", tokenizer from {tokenizer}" if tokenizer else ", no tokenizer"
    )
    if lora is not None:
        what += ", base model" if args.peft else ", LoRA adapters merged"
    print(f"converted {src} ({model.config.model_type}) -> {dst} ({what})")
    if args.peft:
        print(f"PEFT LoRA adapter -> {args.peft}")
    return 0


def _load_for_export(src: Path, config: str | None, export_dtype: Any) -> tuple[Any, dict | None, Any]:
    """(model with its float32 weights, the run's lora_config or None, the dtype to write).

    The weights are read in float32 (a training checkpoint holds the fp32 masters) and cast once, on
    writing, to --dtype, else to the run's compute dtype (float32 for ``auto``, which depends on the
    machine)."""
    import torch

    from lmforge.config import validate_section
    from lmforge.models import build_model, build_model_config, load_model_checkpoint
    from lmforge.models.io import SECTION_FILE

    if (src / SECTION_FILE).is_file():
        from lmforge.models.io import saved_compute_dtype

        return load_model_checkpoint(src, dtype=torch.float32), None, export_dtype or saved_compute_dtype(src)
    from lmforge.train.checkpoint import load_model_weights

    section = model_section_for(src, config)
    if "hf_config" not in section:  # a written-out section fine-tuned from a Hugging Face directory
        carried = _base_hf_config(model_section_for(src, config, "checkpoint"))
        section = {**section, "hf_config": carried} if carried else section
    typed = build_model_config(validate_section("model", section))
    out_dtype = export_dtype or (torch.float32 if typed.compute_dtype_auto else typed.compute_dtype)
    model = build_model(validate_section("model", {**section, "compute_dtype": "float32"}), device="meta")
    lora = model_section_for(src, config, "lora_config")
    if lora is not None:
        from lmforge.models.lora import apply_lora

        # The section is read raw from the run's file: typed once here, so that the adapters are read.
        apply_lora(model, validate_section("lora_config", lora))
    model.to_empty(device="cpu")
    model.init_weights()
    load_model_weights(src, model)
    return model, lora, out_dtype


def _base_hf_config(checkpoint: dict | None) -> dict | None:
    """The config.json keys lmforge does not model (token ids, ...) of the Hugging Face directory the run
    started from (``checkpoint.load_path``), so that the export writes them back; None without one."""
    import json

    from lmforge.errors import LmforgeError
    from lmforge.models.hf_io import HF_CONFIG_KEY, section_from_hf_config

    load_path = (checkpoint or {}).get("load_path")
    config_json = Path(load_path) / "config.json" if isinstance(load_path, str) and load_path else None
    if config_json is None or not config_json.is_file():
        return None
    try:
        hf_cfg = json.loads(config_json.read_text(encoding="utf-8"))
        return section_from_hf_config(hf_cfg).get(HF_CONFIG_KEY) if isinstance(hf_cfg, dict) else None
    except (OSError, ValueError, LmforgeError) as exc:
        print(f"note: the keys of {config_json} beyond the model's structure are not carried over ({exc})")
        return None


def _check_template(template: str, path: str) -> None:
    """A template that does not compile is refused here, not written into the export for transformers'
    apply_chat_template (or ``lmforge generate``) to fail on later."""
    from lmforge.data.text_format import compile_template
    from lmforge.errors import DataError

    try:
        compile_template(template)
    except DataError as exc:
        raise ConfigError(f"--chat-template {path}: {exc}. Fix the template file.") from None


def _run_chat_template(src: Path, config: str | None) -> str | None:
    """``train_dataset.dataloader.chat_template`` of the run (``--config``, else the checkpoint's
    config.yaml), as template text; None when the run set none (the tokenizer's own is exported)."""
    from lmforge.config import read_raw
    from lmforge.data.text_format import BUILTIN_TEMPLATES
    from lmforge.train.checkpoint import CONFIG_FILE, resolve_checkpoint

    if config is None:
        header = resolve_checkpoint(src, "--from")
        saved = header.path / CONFIG_FILE if header is not None and header.kind == "dcp" else None
        if saved is None or not saved.is_file():
            return None
        config = str(saved)
    raw, _ = read_raw(config)
    dataset = raw.get("train_dataset")
    loader = dataset.get("dataloader") if isinstance(dataset, dict) else None
    template = loader.get("chat_template") if isinstance(loader, dict) else None
    if not isinstance(template, str) or not template:
        return None
    return BUILTIN_TEMPLATES.get(template, template)


def _tokenizer_for(src: Path, args: argparse.Namespace) -> Path:
    """--tokenizer, else a tokenizer.json in the checkpoint, else the one of the run's data."""
    from lmforge.errors import DataError

    if args.tokenizer:
        return Path(args.tokenizer)
    from lmforge.train.checkpoint import CONFIG_FILE, resolve_checkpoint

    header = None if (src / "tokenizer.json").is_file() else resolve_checkpoint(src, "--from")
    where = header.path if header is not None else src
    if (where / "tokenizer.json").is_file():
        return where
    config_file = Path(args.config) if args.config else where / CONFIG_FILE
    if config_file.is_file():
        from lmforge.config import load_config
        from lmforge.train.builder import find_tokenizer

        try:
            found = find_tokenizer(load_config(config_file))
        except ConfigError:
            found = None  # a model-only config.yaml (written by --from-hf) names no data
        if found is not None:
            return found
    raise DataError(
        f"no tokenizer found for {src}: pass --tokenizer PATH (a tokenizer.json or a directory holding one), "
        "or --no-tokenizer to export the weights alone (AutoTokenizer will then not load the directory)."
    )
