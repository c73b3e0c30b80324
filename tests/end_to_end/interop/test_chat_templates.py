"""Chat templates round-trip (training's template exported to tokenizer_config.json and
chat_template.jinja, read back from either), prompt/response rows without a template get a separator,
`lmforge generate` answers a conversation like transformers does, and a template attacking the
sandbox is a clear error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.data.text_format import (
    CHATML,
    PLAIN_SEPARATOR,
    FormatSettings,
    RowFormatter,
    tokenizer_chat_template,
)
from lmforge.errors import DataError
from lmforge.models import build_model, save_hf_pretrained
from lmforge.train.checkpoint import Checkpointable, CheckpointManager

transformers = pytest.importorskip("transformers")

ATTACK = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _formatter(tokenizer_dir, template=None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tok, RowFormatter(
        tok, FormatSettings(chat_template=template, eod=tok.token_to_id("<|endoftext|>"))
    )


def test_prompt_response_without_a_template_gets_the_separator(tokenizer_dir):
    tok, formatter = _formatter(tokenizer_dir)
    [(_, ids, mask)] = formatter.encode_rows(
        [(0, {"prompt": "Hello world", "response": "the earth"})], "rows"
    )
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == "Hello world\n\nthe earth<|endoftext|>"
    prompt_tokens = len(tok.encode("Hello world" + PLAIN_SEPARATOR, add_special_tokens=False).ids)
    assert mask.tolist() == [0] * prompt_tokens + [1] * (len(ids) - prompt_tokens)  # the response + eod


def test_the_template_is_read_from_chat_template_jinja_or_tokenizer_config(tmp_path, tokenizer_dir):
    shutil.copyfile(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert tokenizer_chat_template(str(tmp_path))[0] == CHATML
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages }}", "eos_token": "<|im_end|>"})
    )
    assert tokenizer_chat_template(str(tmp_path / "tokenizer.json")) == ("{{ messages }}", "", "<|im_end|>")


def test_a_template_attacking_the_sandbox_is_a_data_error(tokenizer_dir):
    _, formatter = _formatter(tokenizer_dir, ATTACK)
    with pytest.raises(DataError, match="sandbox refuses"):
        formatter.encode_rows([(0, {"messages": [{"role": "user", "content": "hi"}]})], "rows")


def _training_checkpoint(tmp_path, tiny_section):
    """A DCP checkpoint whose config.yaml trained with chat_template: chatml (and no template in the
    tokenizer files)."""
    torch.manual_seed(0)
    model = build_model(validate_section("model", tiny_section("qwen3")))
    run = {
        "model": tiny_section("qwen3"),
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "chat_template": "chatml"}},
    }
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True, save_max=0, config_dict=run)
    assert manager.save(Checkpointable(model=model), step=1)
    manager.close()
    return model


def test_the_runs_template_is_exported_and_read_back(tmp_path, tokenizer_dir, tiny_section):
    _training_checkpoint(tmp_path, tiny_section)
    args = [
        "convert",
        "--from",
        str(tmp_path / "ckpt"),
        "--to-hf",
        str(tmp_path / "hf"),
        "--tokenizer",
        str(tokenizer_dir),
    ]
    assert main(args) == 0
    hf = tmp_path / "hf"
    assert json.loads((hf / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert (hf / "chat_template.jinja").read_text() == CHATML
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    chat = [{"role": "user", "content": "hi"}]
    assert theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # back to lmforge: the template travels with the checkpoint's tokenizer files
    assert main(["convert", "--from-hf", str(hf), "--to", str(tmp_path / "back")]) == 0
    assert tokenizer_chat_template(str(tmp_path / "back" / "iteration_00000000"))[0] == CHATML
    # only chat_template.jinja (as transformers 5 saves it) is enough too
    config = json.loads((hf / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_chat_template(str(hf))[0] == CHATML


def test_generate_chat_answers_like_transformers(tmp_path, tokenizer_dir, tiny_section, capsys):
    """--chat: the conversation through the exported template, the model's turn only; greedy, the
    same tokens as transformers' generate on the same directory."""
    torch.manual_seed(0)
    model = build_model(validate_section("model", tiny_section("qwen3")))
    (tmp_path / "chat.jinja").write_text(CHATML)
    save_hf_pretrained(model, tmp_path / "hf", tokenizer=tokenizer_dir, chat_template=CHATML)
    chat = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "Hello world"}]
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(tmp_path / "hf"), "--temperature", "0", "--max-new-tokens", "12"]
    assert main([*args, "--chat", "Hello world", "--system", "be kind"]) == 0
    ours = capsys.readouterr().out
    (tmp_path / "messages.json").write_text(json.dumps(chat))
    assert main([*args, "--messages", str(tmp_path / "messages.json")]) == 0
    assert capsys.readouterr().out == ours

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    stops = [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    out = hf.generate(
        ids,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=stops[0],
        output_scores=True,
        return_dict_in_generate=True,
    )
    # Greedy choices are comparable across implementations only when no step is a near tie: the two
    # models' logits agree within 1e-4 (tests/models/test_hf_parity.py), so each margin must exceed that.
    margins = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.scores]
    assert min(margins) > 2e-4, margins
    new = out.sequences[0, ids.shape[1] :].tolist()
    while new and new[-1] in stops:
        new = new[:-1]
    assert len(new) >= 3  # a real answer, not an immediate stop
    assert ours == tok.decode(new, skip_special_tokens=True) + "\n"


def test_generate_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--top-p P" in text
        and "(default: 1.0)" in text
        and "(default: 0.8)" in text
        and "(default: 50)" in text
    )


def test_generate_with_a_template_attacking_the_sandbox_exits_2(
    tmp_path, tokenizer_dir, tiny_section, capsys
):
    save_hf_pretrained(
        build_model(validate_section("model", tiny_section("qwen3"))),
        tmp_path / "hf",
        tokenizer=tokenizer_dir,
    )
    (tmp_path / "attack.jinja").write_text(ATTACK)
    args = [
        "generate",
        "--checkpoint",
        str(tmp_path / "hf"),
        "--chat",
        "hi",
        "--chat-template",
        str(tmp_path / "attack.jinja"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "sandbox refuses" in err and "Traceback" not in err


def test_check_refuses_a_yaml_template_attacking_the_sandbox(
    tmp_path, tokenizer_dir, tiny_section, base_config, capsys
):
    """Found at load (lmforge check), before any model or worker exists."""
    import yaml

    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = dict(base_config, model=tiny_section("qwen3", seq_length=32))
    cfg["train_dataset"] = {
        "dataloader": {
            "type": "TextDataLoader",
            "data_path": [str(tmp_path / "chat.jsonl")],
            "tokenizer": str(tokenizer_dir),
            "seq_length": 32,
            "chat_template": ATTACK,
        }
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["check", "--config", str(tmp_path / "t.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        "train_dataset.dataloader.chat_template" in err
        and "sandbox refuses" in err
        and "Traceback" not in err
    )
