"""``lmforge train``: train from a train.yaml (one process, or every process under torchrun).

lmforge train --config FILE [--set KEY=VALUE ...] [--output-dir DIR]
torchrun --nproc-per-node 2 -m lmforge train --config FILE
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmforge.cli.options import add_set_option


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model from a train.yaml",
        description=(
            "Train from a train.yaml. Outputs (metrics.jsonl, train.log, curves.png, summary.json) go to "
            "output_dir (or --output-dir); checkpoints go to checkpoint.save_path. Under torchrun every "
            "process runs this command. SIGTERM/SIGINT save a checkpoint at the end of the current step."
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="the train.yaml")
    add_set_option(parser, "training.steps=20")
    parser.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help="moves every output of the run to DIR: output_dir, and the checkpoint, TensorBoard and profiler "
        "paths the file places under its own output_dir",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lmforge.config import load_config
    from lmforge.errors import ConfigError
    from lmforge.train.builder import build_trainer
    from lmforge.utils.device import parse_device

    parse_device(args.device)
    config = load_config(args.config, args.overrides)
    trainer = None
    # SIGTERM while the model and data are being built (before the trainer handles signals) must not
    # kill the run either: it is remembered, and the run stops before its first step, saved.
    early: list[str] = []
    built: list[Any] = []  # the trainer, once built
    previous = _remember_signals(early, built)
    try:
        try:
            trainer = build_trainer(config, output_dir=args.output_dir, device=args.device)
        except ConfigError as exc:
            # The run plan's refusal names the file, as load_config's and `lmforge check`'s do.
            text = str(exc)
            if text.startswith("Invalid configuration"):
                raise ConfigError(
                    text.replace("Invalid configuration", f"Invalid configuration in {args.config}", 1)
                ) from None
            raise
        # The start-up handler stays until fit() installs the trainer's own (a SIGTERM in between
        # must not kill this rank: torchrun would count a failure and restart the job); from here
        # it passes signals straight to the trainer.
        built.append(trainer)
        if early:
            trainer.request_stop(f"received {early[0]} during start-up")
        trainer.fit()
    except RuntimeError as exc:  # torch's collective and store errors (DistBackendError, ...)
        _report_distributed_failure(trainer, exc)
        raise
    finally:
        _restore(previous)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _report_distributed_failure(trainer: Any, exc: BaseException) -> None:
    """Name this rank, its phase and where the other ranks were when a collective failed."""
    from lmforge.train.watchdog import active_watchdog

    dog = active_watchdog(trainer)
    if dog is None:
        return
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    message = dog.diagnose(0.0, failure=f"{type(exc).__name__}: {first_line}")
    print(f"lmforge train: error: {message}", file=sys.stderr, flush=True)


def _remember_signals(received: list[str], built: list[Any]) -> dict[int, Any]:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if built:  # request_stop only sets flags: safe here
            built[0].request_stop(f"received {name} during start-up")
        else:
            received.append(name)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM,)}
    for sig in previous:
        signal.signal(sig, handler)
    return previous


def _restore(previous: dict[int, Any]) -> None:
    import signal

    for sig, handler in previous.items():
        signal.signal(sig, handler)
    previous.clear()
