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
