"""``lmforge checkpoint inspect DIR``: list what a checkpoint holds and verify its files."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("checkpoint", help="inspect checkpoints", description="Checkpoint tools.")
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    sub.required = True
    inspect = sub.add_parser(
        "inspect",
        help="list what a checkpoint holds and verify its files",
        description=(
            "Show a checkpoint: the resolved iteration directory (a save_path resolves through "
            "latest_checkpointed_iteration.txt), common.json, the model/optimizer/scheduler/trainer/RNG/"
            "data-position entries with sizes, the trainer counters, and the files, each verified against "
            "the checkpoint's checksums.json (the check a load makes). A damaged or missing file is named "
            "with what was recorded and what was found, and the command exits with status 2. It also says "
            "whether recovery gave up on the run (save_path/recovery_gave_up.json)."
        ),
    )
    inspect.add_argument(
        "dir", metavar="DIR", help="a save_path, an iteration_XXXXXXXX directory or an HF directory"
    )
    inspect.add_argument(
        "--tensors", action="store_true", help="also list every model tensor with shape and dtype"
    )
    inspect.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not read the files to verify their checksums (the description only: quick on a large "
        "checkpoint, but says nothing about whether it would load)",
    )
    inspect.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    import sys

    from lmforge.train.checkpoint.inspect import inspect_checkpoint
    from lmforge.train.recovery.give_up import give_up_note

    result = inspect_checkpoint(args.dir, list_tensors=args.tensors, verify=args.verify, progress=sys.stderr)
    print(result.text, flush=True)
    note = give_up_note(args.dir)  # recovery's give-up marker next to the checkpoints
    if note is not None:
        print(note, flush=True)
    if result.damage is not None:
        raise result.damage
    return 0
