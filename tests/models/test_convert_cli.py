"""``lmforge convert`` both ways, through the CLI entry point, in both checkpoint forms."""

from __future__ import annotations

import pytest
import torch

from lmforge.cli import main
from lmforge.models import load_hf_pretrained


@pytest.mark.parametrize("form", ["dcp", "safetensors"])
def test_convert_hf_to_lmforge_and_back(tmp_path, make_hf_model, form):
    hf = make_hf_model("qwen3")
    hf.save_pretrained(tmp_path / "hf_in")
    assert (
        main(
            [
                "convert",
                "--from-hf",
                str(tmp_path / "hf_in"),
                "--to",
                str(tmp_path / "ckpt"),
                "--format",
                form,
            ]
        )
        == 0
    )
    if form == "dcp":
        assert (tmp_path / "ckpt" / "iteration_00000000" / ".metadata").is_file()
    assert main(["convert", "--to-hf", str(tmp_path / "hf_out"), "--from", str(tmp_path / "ckpt")]) == 0
    a = load_hf_pretrained(tmp_path / "hf_in").state_dict()
    b = load_hf_pretrained(tmp_path / "hf_out").state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_convert_needs_one_direction(capsys):
    assert main(["convert", "--from-hf", "x"]) == 2
    assert "--from-hf DIR --to CKPT_DIR" in capsys.readouterr().err


def test_convert_missing_hf_dir_is_a_user_error(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(tmp_path / "nope"), "--to", str(tmp_path / "c")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
