"""Chat / instruction SFT: loss only on assistant tokens (token by token), HFDataLoader mapping."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.data import build_dataloader
from lmforge.data.text_format import CHATML
from lmforge.errors import ConfigError

from .helpers import typed
from .text_helpers import token_id, write_jsonl, write_tokenizer

S = 32
CONVERSATION = [
    {"role": "system", "content": "be kind"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "w1"},
    {"role": "assistant", "content": "w2 w3"},
]
# ChatML rendered and tokenized (the word-level tokenizer drops the newlines); 1 = trained.
EXPECTED = [
    ("<|im_start|>", 0), ("system", 0), ("be", 0), ("kind", 0), ("<|im_end|>", 0),
    ("<|im_start|>", 0), ("user", 0), ("hi", 0), ("<|im_end|>", 0),
    ("<|im_start|>", 0), ("assistant", 0), ("hello", 1), ("there", 1), ("<|im_end|>", 1),
    ("<|im_start|>", 0), ("user", 0), ("w1", 0), ("<|im_end|>", 0),
    ("<|im_start|>", 0), ("assistant", 0), ("w2", 1), ("w3", 1), ("<|im_end|>", 1),
    ("<|endoftext|>", 1),
]  # fmt: skip


def _section(path, tok, **loader):
    return {
        "dataloader": {
            "type": "TextDataLoader",
            "data_path": [path],
            "tokenizer": tok,
            "seq_length": S,
            "pack": "whole",
            "column_names": ["input_ids", "labels", "loss_mask", "position_ids", "actual_seq_len"],
            **loader,
        },
        "num_parallel_workers": 0,
    }


def _first_row(section):
    loader = build_dataloader(typed(section), local_batch_size=1)
    batch = next(loader)
    loader.close()
    return batch


def _check_row(batch, expected, padded=True):
    ids = [token_id(t) for t, _ in expected]
    n = len(ids)
    assert batch["input_ids"][0, :n].tolist() == ids
    assert batch["labels"][0, : n - 1].tolist() == ids[1:]
    # loss_mask[p] belongs to the label at p, i.e. to token p + 1
    assert batch["loss_mask"][0, : n - 1].tolist() == [float(m) for _, m in expected[1:]]
    if padded:
        assert not batch["loss_mask"][0, n - 1 :].any()  # padding of the row


@pytest.mark.parametrize("where", ["yaml", "yaml_name", "tokenizer_config"])
def test_chat_loss_mask_covers_exactly_the_assistant_tokens(tmp_path, where):
    tok = write_tokenizer(tmp_path / "tok", chat_template=CHATML if where == "tokenizer_config" else None)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3)
    extra = {"yaml": {"chat_template": CHATML}, "yaml_name": {"chat_template": "chatml"}}.get(where, {})
    batch = _first_row(_section(path, tok, **extra))
    _check_row(batch, EXPECTED)
    # whole packing: the next conversation starts a new row, positions restart per document
    assert batch["position_ids"][0, : len(EXPECTED)].tolist() == list(range(len(EXPECTED)))


def test_prompt_response_and_alpaca_columns(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    rows = [{"prompt": "hi", "response": "hello there"}, {"instruction": "w1", "input": "w2", "output": "w3"}]
    path = write_jsonl(tmp_path / "pr.jsonl", rows)
    loader = build_dataloader(typed(_section(path, tok, pack="concat")), local_batch_size=1)
    batch = next(loader)
    loader.close()
    expected = [("hi", 0), ("hello", 1), ("there", 1), ("<|endoftext|>", 1)]
    expected += [("w1", 0), ("w2", 0), ("w3", 1), ("<|endoftext|>", 1)]
    _check_row(batch, expected + expected[:1], padded=False)  # concat: the rows repeat (2 documents)
    # with ChatML the same row becomes a two-turn conversation
    batch = _first_row(_section(path, tok, chat_template="chatml"))
    _check_row(
        batch,
        [
            ("<|im_start|>", 0),
            ("user", 0),
            ("hi", 0),
            ("<|im_end|>", 0),
            ("<|im_start|>", 0),
            ("assistant", 0),
        ]
        + [("hello", 1), ("there", 1), ("<|im_end|>", 1), ("<|endoftext|>", 1)],
        padded=False,  # the next (short) conversation fits in the same row
    )


def test_conversation_without_template_is_a_clear_error(tmp_path):
    from lmforge.errors import DataError

    tok = write_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(DataError, match="needs a chat template"):
        _first_row(_section(path, tok))


@pytest.mark.parametrize(
    "messages, roles",
    [([{"role": "user", "content": "hi"}], "'user'"), ([], "none")],
    ids=["user-only", "empty"],
)
def test_a_conversation_without_an_assistant_turn_is_refused_with_file_and_line(tmp_path, messages, roles):
    # Before: such rows carry no loss; a data set of them trained at loss 0.000000 and grad_norm 0 to the
    # end (exit 0), and an empty list was "a data source yields only empty documents" naming no file.
    from lmforge.errors import DataError

    tok = write_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"messages": messages}])
    with pytest.raises(DataError) as info:
        loader = build_dataloader(typed(_section(path, tok, chat_template="chatml")), local_batch_size=1)
        for _ in range(4):
            next(loader)
    assert f"{path}:2: 'messages' has no assistant turn (roles: {roles})" in str(info.value)


def _hf_section(tmp_path, **extra):
    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir)
    rows = [{"instruction": f"w{i}", "input": "", "output": f"w{i + 1} w{i + 2}"} for i in range(30)]
    data = write_jsonl(tmp_path / "alpaca.json", rows)
    loader = {
        "type": "HFDataLoader",
        "load_func": "load_dataset",
        "path": "json",
        "data_files": data,
        "create_compressed_eod_mask": True,
        "compressed_eod_mask_length": 16,
        "use_broadcast_data": True,
        "shuffle": False,
        "handler": [
            {
                "type": "AlpacaInstructDataHandler",
                "seq_length": S,
                "tokenizer": {"pretrained_model_dir": str(tok_dir)},
            },
            {"type": "PackingHandler", "seq_length": S, "pack_strategy": "pack"},
        ],
        **extra,
    }
    return {"dataloader": loader, "num_parallel_workers": 0}, data, str(tok_dir)


def test_hf_data_loader_maps_onto_the_text_loader(tmp_path):
    section, data, tok = _hf_section(tmp_path)
    ours = _section(data, tok, eod_pad_length=16)
    ours["dataloader"]["column_names"] = [
        "input_ids",
        "labels",
        "loss_mask",
        "position_ids",
        "actual_seq_len",
    ]
    a, b = (
        build_dataloader(typed(section), local_batch_size=2),
        build_dataloader(typed(ours), local_batch_size=2),
    )
    for _ in range(3):
        x, y = next(a), next(b)
        assert sorted(x) == sorted(y) and all(torch.equal(x[c], y[c]) for c in x)
    a.close()
    b.close()
    typed(section).dataloader.typed.check_against_model(S, None)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"handler": [{"type": "take", "n": 5}]}, r"handler\[0\]\.type = 'take' has no equivalent"),
        ({"num_samples": 4}, r"dataloader\.num_samples of HFDataLoader has no equivalent"),
        ({"path": "tatsu-lab/alpaca", "data_files": None}, "local data only"),
        ({"load_func": "load_hub"}, "load_func must be"),
    ],
)
def test_hf_data_loader_keys_without_equivalent_are_refused(tmp_path, change, match):
    section, _, _ = _hf_section(tmp_path)
    section["dataloader"].update(change)
    if change.get("data_files", 1) is None:
        del section["dataloader"]["data_files"]
    with pytest.raises(ConfigError, match=match):
        typed(section)
    json.dumps(section)  # the section stays plain data
