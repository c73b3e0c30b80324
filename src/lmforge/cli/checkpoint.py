"""``lmforge checkpoint inspect DIR``: list what a checkpoint holds."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("checkpoint", help="inspect checkpoints", description="Checkpoint tools.")
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    sub.required = True
    inspect = sub.add_parser(
        "inspect",
        help="list what a checkpoint holds",
        description=(
            "Show a checkpoint: the resolved iteration directory (a save_path resolves through "
            "latest_checkpointed_iteration.txt), common.json, the model/optimizer/scheduler/trainer/RNG/"
            "data-position entries with sizes, the trainer counters, and the files; and whether recovery "
            "gave up on the run (save_path/recovery_gave_up.json)."
        ),
    )
    inspect.add_argument(
        "dir", metavar="DIR", help="a save_path, an iteration_XXXXXXXX directory or an HF directory"
    )
    inspect.add_argument(
        "--tensors", action="store_true", help="also list every model tensor with shape and dtype"
    )
    inspect.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from lmforge.train.checkpoint.inspect import describe_checkpoint
    from lmforge.train.recovery.give_up import give_up_note

    print(describe_checkpoint(args.dir, list_tensors=args.tensors))
    note = give_up_note(args.dir)  # recovery's give-up marker next to the checkpoints
    if note is not None:
        print(note)
    return 0
