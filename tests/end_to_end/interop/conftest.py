"""A tiny byte-level BPE tokenizer with chat special tokens, and tiny lmforge models, for export tests."""

from __future__ import annotations

import pytest

TEXT = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "Hello world! Numbers 12345 and symbols #$% and unicode: café, naïve, 日本.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A directory with only tokenizer.json (as `lmforge data demo` writes), vocabulary 300."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 4, trainer=trainer)
    out = tmp_path_factory.mktemp("tok")
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def sample_text():
    return list(TEXT)


@pytest.fixture(scope="session")
def tiny_section():
    """A function: the model section of a tiny llama or qwen3 with vocabulary 300, plus overrides."""
    return _tiny_section


def _tiny_section(model_type: str = "llama", **overrides):
    section = {
        "model_type": model_type,
        "architectures": {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "compute_dtype": "float32",
        "initializer_range": 0.2,
    }
    section.update(overrides)
    return section


def _wandb_records(path):
    """The protobuf records of an offline W&B run file (run-ID.wandb): W&B's LevelDB-style log of
    32 KiB blocks, records split in FULL/FIRST/MIDDLE/LAST chunks behind a 7-byte header. Written
    here because wandb >= 0.19 ships no Python reader (its Go core writes the file)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def _finished_wandb_records(path, timeout: float = 30.0):
    """All records of a finished run: wandb-core may still be writing the file when ``finish()``
    returns in offline mode, so wait for the run's ``exit`` record."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


@pytest.fixture(scope="session")
def wandb_records():
    return _finished_wandb_records
