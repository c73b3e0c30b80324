"""``lmforge eval``: the validation loss and perplexity of a checkpoint, once.

The config is ``--config`` (the run's train.yaml), else the ``config.yaml`` saved inside the
checkpoint, so ``lmforge eval --checkpoint DIR`` works on its own for a pretraining, SFT or LoRA
checkpoint; ``--set`` overrides either. The model comes from its ``model`` (and ``lora_config``)
section, its weights from ``--checkpoint`` (an lmforge checkpoint: a save_path with its tracker file
or one ``iteration_XXXXXXXX`` directory; or a Hugging Face model directory, with ``--config``); the
data is the ``valid`` split of ``eval_dataset`` (or of ``train_dataset``),
``training.local_batch_size`` samples per batch, ``eval_steps`` batches (``--eval-steps``; default:
the whole split). One process.

``--tasks a,b,file.jsonl``: downstream tasks through lm-evaluation-harness instead (extra ``[eval]``),
with lmforge's model as the harness model; see ``lmforge.train.callbacks.lm_eval_harness``. The config is optional
then (an lmforge checkpoint's own ``config.yaml`` is used); results go to ``lm_eval_results.json``
in the checkpoint directory (or ``--output``) and into the run's trackers (``monitor.wandb`` /
``monitor.mlflow``) at the checkpoint's step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `lmforge --help` must not pay for it
    import torch

from lmforge.cli.options import add_set_option

if TYPE_CHECKING:
    from lmforge.config import TrainConfig


DEFAULT_BATCH_SIZE = 8
# The harness's flags: read only with --tasks, so without it each is refused rather than ignored.
_TASK_FLAGS = {
    "limit": "--limit",
    "num_fewshot": "--num-fewshot",
    "include_path": "--include-path",
    "tokenizer": "--tokenizer",
    "batch_size": "--batch-size",
    "output": "--output",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="validation loss and perplexity of a checkpoint",
        description=(
            "Evaluate a checkpoint on the validation split of the config's data: prints the loss (mean "
            "over all valid label tokens) and the perplexity exp(loss)."
        ),
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint directory to evaluate")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="train.yaml for the model and the validation data (default: the config.yaml saved with the "
        "checkpoint)",
    )
    add_set_option(parser, "eval_steps=50")
    parser.add_argument("--eval-steps", type=int, default=None, metavar="N", help="batches to evaluate")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    harness = parser.add_argument_group("downstream tasks (lm-evaluation-harness, extra [eval])")
    harness.add_argument(
        "--tasks",
        metavar="LIST",
        help="comma-separated harness task names and/or local .jsonl task files (docs/guide.md)",
    )
    harness.add_argument("--limit", type=int, default=None, metavar="N", help="at most N items per task")
    harness.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples")
    harness.add_argument("--include-path", metavar="DIR", help="directory of extra harness task YAMLs")
    harness.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a directory with one")
    harness.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help=f"sequences per forward (default {DEFAULT_BATCH_SIZE})",
    )
    harness.add_argument("--output", metavar="FILE", help="results file (default: in the checkpoint dir)")
    parser.set_defaults(func=run)


def _load_model(
    checkpoint: Path, model_section: Any, device: torch.device, lora_section: Any = None
) -> torch.nn.Module:
    from lmforge.train.checkpoint import is_hf_model_dir, load_model_weights

    if checkpoint.is_dir() and is_hf_model_dir(checkpoint):
        from lmforge.models import load_hf_pretrained

        return load_hf_pretrained(checkpoint, device=device)
    from lmforge.models import build_model, build_model_config
    from lmforge.utils.model_size import check_model_fits

    check_model_fits(build_model_config(model_section), device)
    model = build_model(model_section, device=device)
    if lora_section is not None:
        from lmforge.models.lora import apply_lora

        apply_lora(model, lora_section)  # the checkpoint's adapters are loaded with the base
    load_model_weights(checkpoint, model)
    return model


def run(args: argparse.Namespace) -> int:
    import torch

    from lmforge.errors import ConfigError

    if args.tasks:
        if args.eval_steps is not None:
            raise ConfigError(
                "--eval-steps counts batches of the validation loss; with --tasks, limit the items per task "
                "with --limit N instead."
            )
        return _run_tasks(args)
    given = [flag for attr, flag in _TASK_FLAGS.items() if getattr(args, attr) is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to downstream tasks (--tasks LIST); without --tasks, lmforge eval "
            "computes the validation loss and would ignore it. Add --tasks, or drop it."
        )
    from lmforge.train.callbacks.logging import readable_number
    from lmforge.train.callbacks.validation import build_eval_loader, eval_settings, evaluate

    config = _run_config(Path(args.checkpoint), args.config, args.overrides)
    settings = eval_settings(config)
    steps = args.eval_steps if args.eval_steps is not None else settings.steps
    if steps is not None and steps <= 0:
        raise ConfigError(f"--eval-steps must be a positive number of batches, got {steps}")
    from lmforge.utils.device import parse_device

    device = torch.device(parse_device(args.device) or ("cuda" if torch.cuda.is_available() else "cpu"))
    loader = build_eval_loader(config)  # data problems are found before the model is built
    model = _load_model(Path(args.checkpoint), config.model, device, config.lora_config)
    result = evaluate(model, loader, max_batches=steps, device=device)
    if args.json:
        print(
            json.dumps({"checkpoint": str(args.checkpoint), **result.as_metrics(), "batches": result.batches})
        )
    else:
        print(
            f"checkpoint: {args.checkpoint}\nval_loss: {result.loss:.6f}\nval_ppl: {readable_number(result.perplexity)}\n"
            f"tokens: {result.tokens}\nbatches: {result.batches}",
            file=sys.stdout,
        )
    return 0


def _run_config(checkpoint: Path, config: str | None, overrides: Any) -> Any:
    """``--config`` when given, else the ``config.yaml`` the run saved with the checkpoint (the whole
    train.yaml: model, LoRA, data); ``--set`` applies to either."""
    from lmforge.config import load_config
    from lmforge.errors import CheckpointError, ConfigError
    from lmforge.train.checkpoint import CONFIG_FILE, resolve_checkpoint

    if config:
        return load_config(config, overrides)
    from lmforge.utils.atomic import recover_dir

    recover_dir(checkpoint)
    header = resolve_checkpoint(checkpoint, "--checkpoint")
    if header is None:
        raise CheckpointError(f"No checkpoint found at {checkpoint}: the directory is missing or empty.")
    saved = header.path / CONFIG_FILE
    if header.kind == "hf" or not saved.is_file():
        raise ConfigError(
            f"{header.path} has no {CONFIG_FILE} (the training config lmforge saves with each checkpoint); give "
            "the run's train.yaml with --config FILE for the model and the validation data."
        )
    try:
        return load_config(saved, overrides)
    except ConfigError as exc:
        raise ConfigError(
            f"{saved} (the checkpoint's own config) cannot be used for the validation loss: {exc} Give the "
            "run's train.yaml with --config FILE, or fix it with --set."
        ) from None


def _task_model(
    header: Any, cfg: TrainConfig | None, args: argparse.Namespace, device: torch.device
) -> tuple[Any, Any]:
    """(model with the checkpoint's weights, LoRA adapters included; tokenizer path or None)."""
    from lmforge.train.builder import find_tokenizer

    tokenizer_path = Path(args.tokenizer) if args.tokenizer else None
    if header.kind == "hf":
        return _load_model(header.path, None, device), tokenizer_path or header.path
    if cfg is not None:
        model = _load_model(header.path, cfg.model, device, cfg.lora_config)
    else:  # a model-only config.yaml, as `lmforge convert --from-hf` writes
        from lmforge.cli.convert import model_section_for
        from lmforge.config import validate_section

        section = validate_section("model", model_section_for(header.path, None))
        model = _load_model(header.path, section, device)
    if tokenizer_path is None:
        saved = header.path / "tokenizer.json"
        fallback = find_tokenizer(cfg) if cfg is not None else None
        tokenizer_path = saved if saved.is_file() else fallback
    return model, tokenizer_path


RESULTS_FILE = "lm_eval_results.json"
# How long `eval --tasks` waits to learn whether the Hugging Face Hub answers at all.
HUB_PROBE_TIMEOUT_S = 3.0


def _hub_unreachable(tasks: list[str], include_path: str | None) -> str | None:
    """The Hub's address when registry tasks may need it and it does not answer within
    ``HUB_PROBE_TIMEOUT_S`` (then the datasets libraries are put in offline mode, so that a dataset
    missing from the cache fails at once instead of after their retries and timeouts); else None."""
    import os
    import socket
    from urllib.parse import urlparse

    if all(t.endswith(".jsonl") for t in tasks) and not include_path:
        return None  # local files only: no network (lm_eval_harness sets offline mode itself)
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "TRUE", "yes"):
        return endpoint  # the user's own offline mode: a missing dataset is the same clear error
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
        return None
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        return endpoint


def _saved_config(path: Path, overrides: Any) -> Any:
    """A training checkpoint's full config.yaml (output_dir and trackers come from it), with ``--set``;
    None for a model-only config.yaml, as `lmforge convert --from-hf` writes. A ``--set`` that makes a full
    config invalid, or one given for a model-only config, is an error: it is never silently dropped."""
    from lmforge.config import load_config
    from lmforge.errors import ConfigError

    try:
        load_config(path)
    except ConfigError:
        if overrides:
            raise ConfigError(
                f"--set: {path} is not a full train config (a model-only one, as `lmforge convert --from-hf` "
                "writes), so there is nothing for --set to apply to; pass the run's train.yaml with --config."
            ) from None
        return None
    return load_config(path, overrides)


def _run_tasks(args: argparse.Namespace) -> int:
    import torch

    from lmforge.config import load_config
    from lmforge.errors import CheckpointError, ConfigError, DataError
    from lmforge.train.callbacks.lm_eval_harness import (
        evaluate_tasks,
        flat_results,
        require_lm_eval,
        split_tasks,
    )
    from lmforge.train.callbacks.lm_eval_offline import first_uncached_task, is_missing_download
    from lmforge.train.checkpoint import CONFIG_FILE, resolve_checkpoint
    from lmforge.utils.tokenizer import find_eod_id, load_tokenizer

    require_lm_eval()
    offline = _hub_unreachable(split_tasks(args.tasks), args.include_path)
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH_SIZE
    for name, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be a positive number, got {value}.")
    if offline is not None and not args.include_path:  # before the harness indexes its tasks
        uncached = first_uncached_task(split_tasks(args.tasks))
        if uncached is not None:
            raise DataError(
                f"--tasks {args.tasks}: the dataset of {uncached.task} ({uncached.dataset}) is not in the local "
                f"Hugging Face cache and {offline} cannot be reached (offline); run it once with network "
                "access to cache it, or use a local .jsonl task (docs/guide.md)."
            )
    from lmforge.utils.device import parse_device

    # The same check as the validation-loss path: a device this machine lacks is named, not a torch error.
    device = torch.device(parse_device(args.device) or ("cuda" if torch.cuda.is_available() else "cpu"))
    header = resolve_checkpoint(args.checkpoint, "--checkpoint")
    if header is None:
        raise CheckpointError(
            f"--checkpoint {args.checkpoint}: no checkpoint there (missing or empty directory)."
        )
    cfg = None
    if args.config:
        cfg = load_config(args.config, args.overrides)
    elif (header.path / CONFIG_FILE).is_file():
        cfg = _saved_config(header.path / CONFIG_FILE, args.overrides)
    model, tokenizer_path = _task_model(header, cfg, args, device)
    if tokenizer_path is None:
        raise DataError(
            f"no tokenizer found for {header.path}: pass --tokenizer PATH (a tokenizer.json or a directory)."
        )
    tokenizer = load_tokenizer(tokenizer_path)
    mc = model.config
    try:
        results = evaluate_tasks(
            model,
            tokenizer,
            args.tasks,
            eot_id=find_eod_id(tokenizer, tokenizer_path),
            max_length=int(getattr(mc, "seq_length", None) or mc.max_position_embeddings),
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            include_path=args.include_path,
            batch_size=args.batch_size,
        )
    except Exception as exc:  # noqa: BLE001 (datasets / huggingface_hub raise many kinds of network errors)
        if offline is None or not is_missing_download(exc):
            raise
        raise DataError(
            f"--tasks {args.tasks}: a task's dataset is not in the local Hugging Face cache and {offline} cannot be "
            "reached (offline); run it once with network access to cache it, or use a local .jsonl task "
            "(docs/guide.md)."
        ) from None
    step = header.global_step
    record = {
        "checkpoint": str(header.path),
        "step": step,
        "tasks": split_tasks(args.tasks),
        "results": results,
    }
    output = Path(args.output) if args.output else header.path / RESULTS_FILE
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    logged = []
    if cfg is not None:
        from lmforge.train.callbacks.trackers import log_to_run_trackers

        logged = log_to_run_trackers(cfg, cfg.output_dir, flat_results(results), step)
    if args.json:
        print(json.dumps({**record, "output": str(output), "trackers": logged}))
    else:
        for task, metrics in results.items():
            print(
                f"{task}: "
                + ", ".join(f"{k.removesuffix(',none')} {v:.4f}" for k, v in sorted(metrics.items()))
            )
        print(f"results: {output}" + (f" (logged to {', '.join(logged)})" if logged else ""))
    return 0
