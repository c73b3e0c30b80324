"""A Hugging Face directory is untrusted input: `lmforge convert --from-hf` refuses, with exit 2 and a
message naming the file and the tensor, every directory whose index, headers, dtypes or shapes are wrong
or disagree with its config.json, before reading any weight (never a traceback, never a silent cast)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.models import build_model, save_hf_pretrained


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_section):
    """A valid two-layer llama directory in several safetensors files with an index."""
    out = tmp_path_factory.mktemp("hf") / "model"
    torch.manual_seed(0)
    save_hf_pretrained(
        build_model(validate_section("model", tiny_section("llama"))), out, max_shard_size="40KB"
    )
    return out


@pytest.fixture
def copy(hf_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(hf_dir, target)
    return target


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def _file_of(path, name):
    return path / _index(path)["weight_map"][name]


def _rewrite_tensor(path, name, tensor):
    """Replace one tensor in the file that holds it (the index keeps pointing there)."""
    file = _file_of(path, name)
    tensors = load_file(str(file))
    tensors[name] = tensor
    save_file(tensors, str(file), metadata={"format": "pt"})


def _convert(src, tmp_path, capsys):
    code = main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written
    return err


def test_the_valid_directory_converts(hf_dir, tmp_path):
    assert main(["convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "out")]) == 0


def test_an_int32_tensor_is_refused_not_cast(copy, tmp_path, capsys):
    name = "model.layers.0.input_layernorm.weight"
    _rewrite_tensor(copy, name, torch.ones(64, dtype=torch.int32))
    err = _convert(copy, tmp_path, capsys)
    assert f"'{name}' (I32" in err and "not floating point" in err


def test_a_tensor_of_the_wrong_shape_is_named(copy, tmp_path, capsys):
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite_tensor(copy, name, torch.zeros(64, 80))
    err = _convert(copy, tmp_path, capsys)
    assert f"'{name}' is [64, 80]" in err and "needs [64, 96]" in err


def test_config_json_disagreeing_with_the_weights(copy, tmp_path, capsys):
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    err = _convert(copy, tmp_path, capsys)
    assert "the weights do not match config.json" in err and "needs [128, 64]" in err


def test_config_json_with_fewer_layers_than_the_weights(copy, tmp_path, capsys):
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    err = _convert(copy, tmp_path, capsys)
    assert "are not part of the model config.json describes" in err and "model.layers.1." in err


def test_a_corrupt_safetensors_header(copy, tmp_path, capsys):
    file = _file_of(copy, "model.embed_tokens.weight")
    data = bytearray(file.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")  # a header length far beyond the file
    file.write_bytes(bytes(data))
    err = _convert(copy, tmp_path, capsys)
    assert f"{file} is not a readable safetensors file" in err


def test_a_corrupt_single_file(copy, tmp_path, capsys):
    (copy / "model.safetensors.index.json").unlink()
    for f in copy.glob("model-*.safetensors"):
        f.unlink()
    (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    err = _convert(copy, tmp_path, capsys)
    assert "model.safetensors is not a readable safetensors file" in err


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ("{not json", "is not a safetensors index"),
        (json.dumps({"weight_map": ["a", "b"]}), "'weight_map' must be a non-empty object"),
        (json.dumps({"metadata": {}}), "is not a safetensors index"),
        (json.dumps({"weight_map": {"model.norm.weight": "../../etc/passwd"}}), "may name only .safetensors"),
        (json.dumps({"weight_map": {"model.norm.weight": "gone.safetensors"}}), "does not exist"),
    ],
)
def test_a_corrupt_index(copy, tmp_path, capsys, index, expected):
    (copy / "model.safetensors.index.json").write_text(index)
    assert expected in _convert(copy, tmp_path, capsys)


def test_an_index_naming_a_tensor_its_file_lacks(copy, tmp_path, capsys):
    index = _index(copy)
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "does not hold the tensor 'model.extra.weight'" in _convert(copy, tmp_path, capsys)


def test_config_json_that_is_not_an_object(copy, tmp_path, capsys):
    (copy / "config.json").write_text("[1, 2]")
    assert "config.json must hold a JSON object" in _convert(copy, tmp_path, capsys)
