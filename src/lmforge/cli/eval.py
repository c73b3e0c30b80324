"""``lmforge eval``: the validation loss and perplexity of a checkpoint, once.

The model comes from ``model`` of the config, its weights from ``--checkpoint`` (an lmforge
checkpoint: a save_path with its tracker file or one ``iteration_XXXXXXXX`` directory; or a Hugging
Face model directory); the data is the ``valid`` split of ``eval_dataset`` (or of ``train_dataset``),
``training.local_batch_size`` samples per batch, ``eval_steps`` batches (``--eval-steps``; default:
the whole split). One process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lmforge.cli.options import add_set_option


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
    parser.add_argument("--config", required=True, metavar="FILE", help="the run's train.yaml")
    add_set_option(parser, "eval_steps=50")
    parser.add_argument("--eval-steps", type=int, default=None, metavar="N", help="batches to evaluate")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(func=run)


def _load_model(checkpoint: Path, model_section: Any, device: torch.device) -> torch.nn.Module:
    from lmforge.train.checkpoint import is_hf_model_dir, load_model_weights

    if checkpoint.is_dir() and is_hf_model_dir(checkpoint):
        from lmforge.models import load_hf_pretrained

        return load_hf_pretrained(checkpoint, device=device)
    from lmforge.models import build_model, build_model_config
    from lmforge.utils.model_size import check_model_fits

    check_model_fits(build_model_config(model_section), device)
    model = build_model(model_section, device=device)
    load_model_weights(checkpoint, model)
    return model


def run(args: argparse.Namespace) -> int:
    from lmforge.config import load_config
    from lmforge.errors import ConfigError
    from lmforge.train.evaluate import build_eval_loader, eval_settings, evaluate

    config = load_config(args.config, args.overrides)
    settings = eval_settings(config)
    steps = args.eval_steps if args.eval_steps is not None else settings.steps
    if steps is not None and steps <= 0:
        raise ConfigError(f"--eval-steps must be a positive number of batches, got {steps}")
    from lmforge.utils.device import parse_device

    device = torch.device(parse_device(args.device) or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _load_model(Path(args.checkpoint), config.model, device)
    loader = build_eval_loader(config)
    result = evaluate(model, loader, max_batches=steps, device=device)
    if args.json:
        print(
            json.dumps({"checkpoint": str(args.checkpoint), **result.as_metrics(), "batches": result.batches})
        )
    else:
        print(
            f"checkpoint: {args.checkpoint}\nval_loss: {result.loss:.6f}\nval_ppl: {result.perplexity:.4f}\n"
            f"tokens: {result.tokens}\nbatches: {result.batches}",
            file=sys.stdout,
        )
    return 0
