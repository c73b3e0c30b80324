"""A tiny word-level tokenizer with ChatML special tokens, and small text datasets in every format."""

from __future__ import annotations

import gzip
import json

WORDS = [f"w{i}" for i in range(40)] + ["system", "user", "assistant", "hello", "there", "hi", "be", "kind"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(directory, chat_template: str | None = None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIAL, "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if chat_template is not None:
        config = {"chat_template": chat_template, "eos_token": "<|endoftext|>"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory / "tokenizer.json")


def token_id(word: str) -> int:
    return [*SPECIAL, "<unk>", *WORDS].index(word)


def text_rows(n: int, seed: int = 0, vocab: range = range(40)) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {"text": " ".join(f"w{rng.choice(vocab)}" for _ in range(rng.randint(1, 13))), "id": i}
        for i in range(n)
    ]


def write_jsonl(path, rows, compress: bool = False) -> str:
    data = "".join(json.dumps(r) + "\n" for r in rows)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data)
    return str(path)
