"""`lmforge convert --to-hf` output loaded by transformers 5 (installed): logits, tokenizer, config."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.models import build_model, save_model_checkpoint

transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _export(tmp_path, section, *extra):
    torch.manual_seed(0)
    model = build_model(validate_section("model", section))
    save_model_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(out), *extra]) == 0
    return model, out


@pytest.mark.parametrize(
    ("model_type", "rope"),
    [("llama", {"rope_theta": 1.0e6, "rope_scaling": LLAMA3}), ("qwen3", {"rope_theta": 5.0e5})],
)
def test_export_loads_in_transformers_with_same_logits_and_tokens(
    tmp_path, tokenizer_dir, tiny_section, sample_text, model_type, rope
):
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    model, out = _export(
        tmp_path,
        tiny_section(model_type, **rope),
        "--tokenizer",
        str(tokenizer_dir),
        "--max-shard-size",
        "40KB",
        "--chat-template",
        str(template),
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    from safetensors import safe_open

    for f in files:  # each file within the limit, unless it holds one tensor larger than that
        with safe_open(str(out / f), framework="pt") as st:
            sizes = [st.get_tensor(k).nbytes for k in st.keys()]  # noqa: SIM118
        assert len(sizes) == 1 or sum(sizes) <= 40_000
    assert not (out / "model.safetensors").exists()

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.rope_parameters["rope_theta"] == rope["rope_theta"]
    ids = torch.randint(0, 300, (2, 48))  # longer than original_max_position_embeddings: scaling matters
    with torch.no_grad():
        assert (model(ids).logits - hf(input_ids=ids).logits).abs().max() <= 1e-4

    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in sample_text + ["<|im_start|>user\nhi<|im_end|>"]:
        assert theirs(text)["input_ids"] == ours.encode(text).ids
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.token_to_id("<|endoftext|>")
    chat = theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == ours.token_to_id("<|endoftext|>")


def test_config_json_has_rope_in_both_forms(tmp_path, tiny_section):
    _, out = _export(tmp_path, tiny_section("llama", rope_theta=1.0e6, rope_scaling=LLAMA3), "--no-tokenizer")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 1.0e6 and cfg["rope_parameters"]["rope_theta"] == 1.0e6
    assert cfg["rope_scaling"] == {**LLAMA3} and cfg["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert not (out / "tokenizer.json").exists()


def test_export_without_a_tokenizer_is_a_clear_error(tmp_path, tiny_section, capsys):
    model = build_model(validate_section("model", tiny_section()))
    save_model_checkpoint(model, tmp_path / "ckpt")
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer found" in err and "--tokenizer PATH" in err and "--no-tokenizer" in err


def test_bad_shard_size_is_refused_before_loading(tmp_path, capsys):
    args = [
        "convert",
        "--from",
        str(tmp_path / "none"),
        "--to-hf",
        str(tmp_path / "hf"),
        "--max-shard-size",
        "5XB",
    ]
    assert main(args) == 2
    assert "--max-shard-size = '5XB' is not a size" in capsys.readouterr().err


def test_fallback_writer_without_torch_hf_storage(tmp_path, monkeypatch):
    """The same layout from plain safetensors where torch lacks HuggingFaceStorageWriter."""
    from lmforge.models import hf_shards

    tensors = {f"w{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    written = {}
    for name, writer in (("dcp", hf_shards._dcp_hf_writer), ("plain", lambda: None)):
        monkeypatch.setattr(hf_shards, "_dcp_hf_writer", writer)
        (tmp_path / name).mkdir()
        files = hf_shards.write_sharded(tensors, tmp_path / name, 1000)
        written[name] = (files, json.loads((tmp_path / name / hf_shards.INDEX_FILE).read_text()))
    assert written["dcp"] == written["plain"]
    assert written["dcp"][0] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    from lmforge.models.hf_io import read_safetensors_dir

    back = read_safetensors_dir(tmp_path / "plain")
    assert all(torch.equal(back[k], v) for k, v in tensors.items()) and back.keys() == tensors.keys()


def test_round_trip_keeps_the_tokenizer(tmp_path, tokenizer_dir, tiny_section):
    """--from-hf keeps the tokenizer files with the checkpoint; --to-hf then finds them by itself."""
    _, hf = _export(tmp_path, tiny_section("qwen3"), "--tokenizer", str(tokenizer_dir))
    assert main(["convert", "--from-hf", str(hf), "--to", str(tmp_path / "dcp")]) == 0
    assert (tmp_path / "dcp" / "iteration_00000000" / "tokenizer.json").is_file()
    assert main(["convert", "--from", str(tmp_path / "dcp"), "--to-hf", str(tmp_path / "hf2")]) == 0
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        assert (hf / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_export_of_a_training_checkpoint_finds_the_run_data_tokenizer(
    tmp_path, tokenizer_dir, tiny_section, base_config
):
    """No --tokenizer, none saved with the checkpoint: the tokenizer.json next to the training data
    named by the checkpoint's config.yaml (the layout of `lmforge data demo`)."""
    import shutil

    from lmforge.train.checkpoint import Checkpointable, CheckpointManager

    (tmp_path / "data").mkdir()
    shutil.copyfile(tokenizer_dir / "tokenizer.json", tmp_path / "data" / "tokenizer.json")
    cfg = dict(base_config, model=tiny_section("qwen3"))
    cfg["train_dataset"]["dataloader"]["config"]["data_path"] = [str(tmp_path / "data" / "train")]
    # the data's sequence length is the model's (load_config checks the data section against the model)
    cfg["train_dataset"]["dataloader"]["config"]["seq_length"] = cfg["model"].get("seq_length", 4096)
    model = build_model(validate_section("model", cfg["model"]))
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True, save_max=0, config_dict=cfg)
    assert manager.save(Checkpointable(model=model), step=3)
    manager.close()
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        tokenizer_dir / "tokenizer.json"
    ).read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token == "<|endoftext|>"


def test_missing_source_checkpoint_is_named(tmp_path, capsys):
    assert main(["convert", "--from", str(tmp_path / "none"), "--to-hf", str(tmp_path / "hf")]) == 2
    assert "--from " + str(tmp_path / "none") + ": no such checkpoint directory" in capsys.readouterr().err
