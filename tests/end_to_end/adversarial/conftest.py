"""The adversarial corpus's shared pieces: one tiny trained run (built once per session, copied
by the cases that damage it), the CLI run in-process, hostile payloads and a "nothing lost" check.

Every case asserts the exit status, the message, that no payload ran (its marker file is absent)
and that what existed before is unchanged (:func:`snapshot` before and after).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.utils.logging import setup_logging
from train.test_train_cli import ADAMW, write_config


class Payload:
    """Unpickling this runs ``open(marker, "w")``: the file exists afterwards iff code ran."""

    def __init__(self, marker: Path, func=None) -> None:
        self.marker = str(marker)
        self.func = func

    def __reduce__(self):
        if self.func is not None:
            return self.func, (f"touch {self.marker}",)
        return open, (self.marker, "w")


def payload_pickle(marker: Path, func=None) -> bytes:
    return pickle.dumps(Payload(marker, func))


def snapshot(root: Path) -> dict[str, str]:
    """Path -> content hash of every file under ``root`` (to prove nothing was lost or changed)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if name == ".lmforge.lock":
                continue
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def rerecord_checksums(iteration_dir: Path) -> None:
    """Rewrite checksums.json to match the files as they are now: an attacker (or a tool) that alters a
    checkpoint can update the record too, so the checks behind it must hold on their own."""
    from lmforge.train.checkpoint.verify import CHECKSUM_FILE, write_checksums

    (iteration_dir / CHECKSUM_FILE).unlink()
    write_checksums(iteration_dir, {})


class Cli:
    """``lmforge ...`` in this process; returns (status, stdout, stderr)."""

    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        setup_logging()  # log to this capture, not to a stream or train.log of an earlier case
        try:
            status = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse
            status = exc.code
        out, err = self.capsys.readouterr()
        return status, out, err


@pytest.fixture
def cli(capsys):
    return Cli(capsys)


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A run trained for 2 steps with the real stack: train.yaml, data/, ckpt/iteration_00000002."""
    root = tmp_path_factory.mktemp("trained")
    cfg = write_config(root, ADAMW, steps=2)
    torch.set_num_threads(1)
    assert main(["train", "--config", cfg, "--set", "checkpoint.save_interleaved_steps=2"]) == 0
    assert (root / "ckpt" / "iteration_00000002" / ".metadata").is_file()
    return root


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A private copy of the trained run, with train.yaml rewritten to point at the copy."""
    dst = tmp_path / "run_copy"
    shutil.copytree(trained, dst)
    text = (dst / "train.yaml").read_text().replace(str(trained), str(dst))
    (dst / "train.yaml").write_text(text)
    return dst


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
