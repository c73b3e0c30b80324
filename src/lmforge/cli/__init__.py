"""The ``lmforge`` command line: wiring only.

Each subcommand lives in its own module of this package and exposes ``register(subparsers)``, which
adds its parser and sets ``func`` (a callable taking the parsed ``argparse.Namespace`` and returning
an exit status). To add a subcommand, write the module and add its name to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import traceback

from lmforge import __version__
from lmforge.cli.threads import apply_thread_defaults
from lmforge.errors import EXIT_USER_ERROR, LmforgeError
from lmforge.utils.launcher_death import end_with_launcher
from lmforge.utils.malloc import apply_malloc_defaults

# Order is the order shown in ``lmforge --help``.
SUBCOMMANDS: list[str] = [
    "check",
    "data",
    "lr",
    "convert",
    "eval",
    "train",
    "generate",
    "checkpoint",
    "doctor",
    "plan",
    "env",
]

# Failures of the machine or the paths given, not of lmforge: a message, not a traceback.
USER_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a path component is a file, not a directory",
    errno.EISDIR: "a directory was given where a file is needed",
    errno.EEXIST: "a file is in the way of a directory to create",
    errno.ENAMETOOLONG: "a file name is too long",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Train large language models from one YAML file.",
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks for user errors (for bug reports)"
    )
    parser.add_argument(
        "--allow-imports",
        action="store_true",
        help="allow the YAML to name Python modules to import (callbacks: [{type: module:Class}]); "
        "only for files you trust (same as LMFORGE_ALLOW_IMPORTS=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"lmforge.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before any subcommand module can import torch: OpenMP reads these once, at load.
    apply_thread_defaults()
    # Freed memory stays in the process instead of being faulted in again every step (utils/malloc.py).
    apply_malloc_defaults()
    try:  # a torchrun worker ends with its launcher (utils/launcher_death.py)
        end_with_launcher()
    except LmforgeError as exc:
        print(f"lmforge: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``--debug`` is accepted anywhere on the line, not only before the subcommand.
    debug = "--debug" in argv
    if debug:
        argv = [a for a in argv if a != "--debug"]
    if "--allow-imports" in argv:
        # An environment variable, so that processes torchrun starts inherit the opt-in.
        from lmforge.train.callbacks.plugins import ALLOW_IMPORTS_ENV

        argv = [a for a in argv if a != "--allow-imports"]
        os.environ[ALLOW_IMPORTS_ENV] = "1"
    parser = build_parser()
    args = parser.parse_args(argv)
    args.debug = debug
    try:
        status = args.func(args)
    except LmforgeError as exc:
        if debug:
            traceback.print_exc()
        if not getattr(exc, "quiet", False):  # quiet: another rank of the job reports it (utils/elastic.py)
            print(f"lmforge {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status  # 2, or 5 for a run that could not train (lmforge.errors)
    except OSError as exc:
        if exc.errno not in USER_ERRNOS:
            raise
        if debug:
            traceback.print_exc()
        where = f" ({exc.filename})" if exc.filename else ""
        print(
            f"lmforge {args.command}: error: {USER_ERRNOS[exc.errno]}{where}: {exc.strerror or exc}. Outputs are "
            "written aside and published only when complete, so what existed before is unchanged; fix the "
            "cause (free space, permissions, the path) and run the command again.",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"lmforge {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else int(status)
