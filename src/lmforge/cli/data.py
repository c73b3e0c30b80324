"""``lmforge data``: build and look at Megatron-format datasets (preprocess, inspect, demo)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="build and inspect Megatron .bin/.idx datasets")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    pre = sub.add_parser("preprocess", help="tokenize JSON lines into PREFIX_{key}_document.{bin,idx}")
    pre.add_argument("--input", required=True, help="JSON-lines file, optionally .gz")
    pre.add_argument("--json-key", default="text", help="field holding each document's text (default: text)")
    pre.add_argument("--tokenizer", required=True, help="a local tokenizer.json or a directory holding one")
    pre.add_argument(
        "--output-prefix", required=True, help="output prefix; Megatron's _{key}_document is appended"
    )
    pre.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document token to each document"
    )
    pre.add_argument(
        "--eod-token", default=None, help="the end-of-document token (default: eos of the tokenizer)"
    )
    pre.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(func=_preprocess)

    ins = sub.add_parser("inspect", help="documents, tokens, length histogram and a decoded sample")
    ins.add_argument("prefix", help="dataset prefix (PREFIX.bin + PREFIX.idx)")
    ins.add_argument("--tokenizer", default=None, help="tokenizer.json to decode a sample with")
    ins.set_defaults(func=_inspect)

    demo = sub.add_parser("demo", help="build the offline demo corpus (King James Bible + 8k BPE)")
    demo.add_argument("--output", default="data/demo", help="output directory (default: data/demo)")
    demo.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    demo.set_defaults(func=_demo)


def _preprocess(args: argparse.Namespace) -> int:
    from lmforge.data.preprocess import PreprocessInterrupted, preprocess
    from lmforge.errors import DataError

    if args.workers < 1:
        raise DataError(f"--workers must be >= 1; got {args.workers}.")
    try:
        s = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            json_key=args.json_key,
            append_eod=args.append_eod,
            eod_token=args.eod_token,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except PreprocessInterrupted as stop:
        print(
            f"lmforge data preprocess: stopped by signal {stop.signum}; nothing was published (a dataset already "
            "at the output prefix is unchanged) and the temporary files were removed.",
            file=sys.stderr,
        )
        return 128 + stop.signum
    print(
        f"wrote {s.output_prefix}.{{bin,idx}}: {s.documents:,} documents"
        + (f" ({s.skipped_empty:,} empty skipped)" if s.skipped_empty else "")
        + f", {s.tokens:,} tokens ({s.dtype}) in {s.seconds:.2f} s = {s.tokens_per_second:,.0f} tokens/s"
    )
    print(f"data_path prefix: {s.output_prefix}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from lmforge.data.inspect import describe

    print(describe(args.prefix, args.tokenizer))
    return 0


def _demo(args: argparse.Namespace) -> int:
    import sys
    import time

    from lmforge.data.demo import build_demo

    start = time.perf_counter()

    def progress(stage: str) -> None:  # on stderr: stdout keeps the summary alone
        print(f"[{time.perf_counter() - start:5.1f} s] {stage} ...", file=sys.stderr, flush=True)

    s = build_demo(args.output, force=args.force, progress=progress)
    if not s.built:
        print(f"{s.output} already holds a complete demo build (use --force to rebuild)")
    else:
        print(f"built {s.output} in {s.seconds:.1f} s")
    print(
        f"  train: {s.train_documents:,} documents, {s.train_tokens:,} tokens -> {s.output}/train.{{bin,idx}}\n"
        f"  valid: {s.valid_documents:,} documents, {s.valid_tokens:,} tokens -> {s.output}/valid.{{bin,idx}}\n"
        f"  tokenizer: {s.output}/tokenizer.json (eod <|endoftext|> = 0)"
    )
    return 0
