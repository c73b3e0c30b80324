"""``lmforge generate``: sample text from a trained checkpoint.

The model is rebuilt from the ``config.yaml`` saved inside the checkpoint (or ``--config``); the
tokenizer is ``--tokenizer``, else the ``tokenizer.json`` saved with the checkpoint, else the one
next to the config's training data. A Hugging Face model directory works too (its own tokenizer).

Two modes: ``--prompt TEXT`` continues a text; ``--chat TEXT`` (one user message, ``--system`` before
it) or ``--messages FILE`` (a JSON list of ``{"role", "content"}``) is a conversation, formatted with
the chat template the model was trained with (``--chat-template FILE``, else the run's
``train_dataset.dataloader.chat_template``, else the tokenizer's: tokenizer_config.json or
chat_template.jinja) and answered with the model's turn only, ending at the template's end-of-turn
marker or the end-of-document token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.config import TrainConfig

if TYPE_CHECKING:  # torch is imported where it is used: `lmforge --help` must not pay for it
    import torch


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="sample text from a checkpoint (a text continuation or a chat answer)",
        description="Continue a prompt, or answer a conversation, with a trained model (temperature, "
        "top-k and top-p sampling; temperature 0 = greedy).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="a save_path, iteration dir or HF dir"
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the text to continue")
    what.add_argument("--chat", metavar="TEXT", help="chat mode: one user message; prints the model's answer")
    what.add_argument(
        "--messages",
        metavar="FILE",
        help='chat mode: a JSON file holding a list of {"role": ..., "content": ...} turns ("-": stdin)',
    )
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for chat mode (default: the run's, else the tokenizer's)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    # Recorded when given, so that one given with --temperature 0 (greedy: it changes nothing) is refused.
    parser.add_argument(
        "--top-k", type=int, default=50, metavar="K", action=_Given, help="0 disables top-k filtering"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        action=_Given,
        help="nucleus sampling mass in (0, 1]; 1 disables it",
    )
    parser.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="tokenizer.json or a directory with one"
    )
    parser.add_argument(
        "--config", default=None, metavar="FILE", help="train.yaml (default: the checkpoint's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.set_defaults(func=run)


class _Given(argparse.Action):
    """Stores the value and records the option as given (``args.given``): a default is not a choice."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", set()), option_string}


def _check_sampling(args: argparse.Namespace) -> None:
    from lmforge.errors import ConfigError

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (0 <= args.temperature < float("inf")):  # also refuses nan
        raise ConfigError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    given = sorted(getattr(args, "given", set()))
    if args.temperature == 0 and given:
        raise ConfigError(
            f"{' and '.join(given)} filter the tokens that sampling draws from, but --temperature 0 is greedy "
            "decoding (always the most likely token), where they change nothing. Drop them, or give a "
            "temperature above 0 to sample."
        )
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 disables top-k filtering), got {args.top_k}")
    if not (0 < args.top_p <= 1):
        raise ConfigError(f"--top-p must be in (0, 1] (1 disables nucleus sampling), got {args.top_p}")
    if not 0 <= args.seed <= 2**64 - 1:  # torch.manual_seed's range (an overflow was a traceback)
        raise ConfigError(f"--seed must be an integer in [0, 2**64 - 1], got {args.seed}")
    if args.chat_template is not None and args.chat is None and args.messages is None:
        raise ConfigError(
            "--chat-template goes with chat mode (--chat or --messages); --prompt continues the text as given."
        )
    if args.system is not None and args.chat is None:
        raise ConfigError("--system goes with --chat (with --messages, put the system turn in the file).")


def _messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """The conversation of chat mode (None: --prompt mode), checked before anything is loaded."""
    from lmforge.errors import ConfigError

    if args.chat is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return [*system, {"role": "user", "content": args.chat}]
    if args.messages is None:
        return None
    try:
        text = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text(encoding="utf-8")
        messages = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--messages {args.messages}: not a readable JSON file ({exc}).") from None
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ConfigError(
            f'--messages {args.messages}: expected a non-empty JSON list of {{"role": "...", "content": "..."}} '
            "turns with string values."
        )
    return messages


def _load(args: argparse.Namespace, device: torch.device) -> tuple[Any, Path | None, Any]:
    """(model, tokenizer path or None, the run's config or None)."""
    from lmforge.config import load_config
    from lmforge.errors import CheckpointError, ConfigError
    from lmforge.models import build_model, load_hf_pretrained
    from lmforge.train.builder import find_tokenizer
    from lmforge.train.checkpoint import CONFIG_FILE, load_model_weights, resolve_checkpoint
    from lmforge.utils.atomic import recover_dir

    recover_dir(Path(args.checkpoint))  # an export killed while publishing left it as .NAME.old
    header = resolve_checkpoint(args.checkpoint, "--checkpoint")
    if header is None:
        raise CheckpointError(
            f"--checkpoint {args.checkpoint}: no checkpoint there (missing or empty directory)."
        )
    tokenizer_path: Path | None = Path(args.tokenizer) if args.tokenizer else None
    if header.kind == "hf":
        return load_hf_pretrained(header.path, device=device), tokenizer_path or header.path, None
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
    if cfg.lora_config is not None:
        from lmforge.models.lora import apply_lora

        apply_lora(model, cfg.lora_config)  # the checkpoint's adapters are loaded with the base
    load_model_weights(header.path, model)
    if tokenizer_path is None:
        saved = header.path / "tokenizer.json"
        tokenizer_path = saved if saved.is_file() else find_tokenizer(cfg)
    return model, tokenizer_path, cfg


def _chat_template(
    args: argparse.Namespace, cfg: TrainConfig | None, tokenizer_path: Path
) -> tuple[str | None, str, str]:
    """(template text or None, bos, eos): --chat-template, else the run's, else the tokenizer's."""
    from lmforge.data.text_format import BUILTIN_TEMPLATES, tokenizer_chat_template
    from lmforge.errors import ConfigError

    own, bos, eos = tokenizer_chat_template(str(tokenizer_path))
    if args.chat_template:
        try:
            return Path(args.chat_template).read_text(encoding="utf-8"), bos, eos
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {args.chat_template}: cannot read it ({exc}).") from None
    # The run's text loader (an HFDataLoader typed as one too) names its template; a Megatron one has none.
    typed_loader = cfg.train_dataset.dataloader.typed if cfg is not None else None
    run_template = getattr(typed_loader, "chat_template", None)
    if isinstance(run_template, str) and run_template:
        return BUILTIN_TEMPLATES.get(run_template, run_template), bos, eos
    return own, bos, eos


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `lmforge --help` must not import it

    from lmforge.errors import ConfigError, DataError
    from lmforge.train.generation import chat_prompt_text, sample_tokens
    from lmforge.utils.device import parse_device
    from lmforge.utils.tokenizer import find_eod_id, load_tokenizer

    _check_sampling(args)
    messages = _messages(args)
    device = torch.device(parse_device(args.device) or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer_path, cfg = _load(args, device)
    if tokenizer_path is None:
        raise DataError(
            f"no tokenizer found for {args.checkpoint}: pass --tokenizer PATH (a tokenizer.json or a directory holding one)."
        )
    tokenizer = load_tokenizer(tokenizer_path)
    try:
        eod = find_eod_id(tokenizer, tokenizer_path)
    except DataError:
        eod = None
    stops: list[list[int]] = []
    if messages is None:
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        template, bos, eos = _chat_template(args, cfg, tokenizer_path)
        prompt, marker = chat_prompt_text(messages, template, bos, eos)
        # As training tokenizes a rendered conversation: no special tokens added around it.
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        stops = [tokenizer.encode(marker, add_special_tokens=False).ids] if marker else []
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens; give some text.")
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and max(prompt_ids) >= vocab:
        # An embedding lookup past the table was an IndexError traceback from inside the model.
        raise DataError(
            f"the prompt encodes to token id {max(prompt_ids)}, but the model has {vocab} token ids "
            f"(model.vocab_size): the tokenizer {tokenizer_path} is not this model's. Give the model's own "
            "tokenizer with --tokenizer PATH."
        )
    new = sample_tokens(
        model,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        context_length=getattr(model.config, "seq_length", None),
        eos_id=eod,
        stop_sequences=stops,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if eod is not None and new and new[-1] == eod:
        new = new[:-1]
    for stop in stops:
        if stop and new[-len(stop) :] == stop:
            new = new[: -len(stop)]
    if messages is not None:  # the model's turn only
        sys.stdout.write(tokenizer.decode(new) + "\n")
        return 0
    # Decode prompt and continuation together: tokenizers without a decoder (word-level) would lose
    # the space between them if the continuation were decoded alone.
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + new)
    continuation = (
        full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else tokenizer.decode(new)
    )
    sys.stdout.write(args.prompt + continuation + "\n")
    return 0
