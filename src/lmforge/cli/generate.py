"""``lmforge generate``: sample text from a trained checkpoint.

The model is rebuilt from the ``config.yaml`` saved inside the checkpoint (or ``--config``); the
tokenizer is ``--tokenizer``, else the ``tokenizer.json`` saved with the checkpoint, else the one
next to the config's training data. A Hugging Face model directory works too (its own tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Continue a prompt with a trained model (temperature / top-k sampling; temperature 0 = greedy).",
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="a save_path, iteration dir or HF dir"
    )
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T")
    parser.add_argument("--top-k", type=int, default=50, metavar="K", help="0 disables top-k filtering")
    parser.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="tokenizer.json or a directory with one"
    )
    parser.add_argument(
        "--config", default=None, metavar="FILE", help="train.yaml (default: the checkpoint's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.set_defaults(func=run)


def _positive(value: int, flag: str) -> None:
    from lmforge.errors import ConfigError

    if value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}")


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `lmforge --help` must not import it

    from lmforge.config import load_config
    from lmforge.data.tokenizer import find_eod_id, load_tokenizer
    from lmforge.errors import CheckpointError, ConfigError, DataError
    from lmforge.models import build_model, load_hf_pretrained
    from lmforge.train.builder import find_tokenizer
    from lmforge.train.checkpoint import CONFIG_FILE, load_model_weights, resolve_checkpoint
    from lmforge.train.generation import sample_tokens
    from lmforge.utils.device import parse_device

    _positive(args.max_new_tokens, "--max-new-tokens")
    if not (0 <= args.temperature < float("inf")):  # also refuses nan
        raise ConfigError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 disables top-k filtering), got {args.top_k}")
    device = torch.device(parse_device(args.device) or ("cuda" if torch.cuda.is_available() else "cpu"))
    header = resolve_checkpoint(args.checkpoint)
    if header is None:
        raise CheckpointError(
            f"--checkpoint {args.checkpoint}: no checkpoint there (missing or empty directory)."
        )
    tokenizer_path: Path | None = Path(args.tokenizer) if args.tokenizer else None
    if header.kind == "hf":
        model = load_hf_pretrained(header.path, device=device)
        tokenizer_path = tokenizer_path or header.path
        context = getattr(model.config, "seq_length", None)
    else:
        config_file = Path(args.config) if args.config else header.path / CONFIG_FILE
        if not config_file.is_file():
            raise ConfigError(
                f"{header.path} has no {CONFIG_FILE}; pass the run's train.yaml with --config FILE."
            )
        cfg = load_config(config_file)
        from lmforge.models import build_model_config
        from lmforge.utils.model_size import check_model_fits

        check_model_fits(build_model_config(cfg.model), device)
        model = build_model(cfg.model, device=device)
        if getattr(cfg, "lora_config", None) is not None:
            from lmforge.models.lora import apply_lora

            apply_lora(model, cfg.lora_config)  # the checkpoint's adapters are loaded with the base
        load_model_weights(header.path, model)
        context = getattr(model.config, "seq_length", None)
        if tokenizer_path is None:
            saved = header.path / "tokenizer.json"
            tokenizer_path = saved if saved.is_file() else find_tokenizer(cfg)
    if tokenizer_path is None:
        raise DataError(
            f"no tokenizer found for {header.path}: pass --tokenizer PATH (a tokenizer.json or a directory holding one)."
        )
    tokenizer = load_tokenizer(tokenizer_path)
    try:
        eod = find_eod_id(tokenizer, tokenizer_path)
    except DataError:
        eod = None
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise ConfigError("--prompt encodes to no tokens; give some text.")
    generator = torch.Generator().manual_seed(args.seed)
    new = sample_tokens(
        model,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        context_length=context,
        eos_id=eod,
        generator=generator,
    )
    if eod is not None and new and new[-1] == eod:
        new = new[:-1]
    # Decode prompt and continuation together: tokenizers without a decoder (word-level) would lose
    # the space between them if the continuation were decoded alone.
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + new)
    continuation = (
        full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else tokenizer.decode(new)
    )
    sys.stdout.write(args.prompt + continuation + "\n")
    return 0
