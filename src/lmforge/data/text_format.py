"""One row of a text dataset → token ids and a per-token loss mask (plain text or chat SFT).

Row kinds, recognised per row by their columns (names configurable):

* ``text``: the whole document is trained on (mask 1).
* ``messages``: a list of ``{"role", "content"}`` turns, rendered with a Jinja chat template (the
  tokenizer's ``chat_template`` from tokenizer_config.json, or ``chat_template`` in the YAML: a
  template string or the built-in name ``chatml``). Only the assistant turns are trained on.
* ``prompt`` / ``response`` (and the Alpaca ``instruction`` / ``input`` / ``output``): one user turn
  and one assistant turn, formatted like ``messages``; without any template the prompt, then
  ``PLAIN_SEPARATOR`` (a blank line, ``"\\n\\n"``), then the response, and only the response is
  trained on.

How the mask is found: the template is rendered for the first i turns and for the first i+1; the
difference is turn i's text. For an assistant turn, the generation prompt (``add_generation_prompt``,
e.g. ``<|im_start|>assistant\\n``) is cut off and not trained; the rest (content, end-of-turn marker)
is. Each piece is tokenized on its own, so the mask is exact token by token. The end-of-document id
follows every document; it is trained when the document's last token is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmforge.data.text_values import check_unicode, text_value
from lmforge.errors import DataError

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML}


@dataclass(frozen=True)
class FormatSettings:
    text_key: str = "text"
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    chat_template: str | None = None  # resolved template text (None: no template)
    bos_token: str = ""
    eos_token: str = ""
    eod: int = 0


# Between a prompt and its response when no chat template applies (a prompt/response or Alpaca row
# and no template in the YAML or with the tokenizer): part of the prompt, never trained on.
# `lmforge generate --chat` puts the same text after a prompt without a template.
PLAIN_SEPARATOR = "\n\n"
TEMPLATE_FILE = "chat_template.jinja"
SANDBOX_REFUSAL = "sandbox refuses"


def tokenizer_chat_template(tokenizer_path: str) -> tuple[str | None, str, str]:
    """(chat_template, bos_token, eos_token) of the tokenizer files next to the tokenizer.

    The template is tokenizer_config.json's ``chat_template``, else the ``chat_template.jinja`` file
    (where transformers 4.43+ and 5 save it); the special tokens come from tokenizer_config.json, which
    is read strictly (``data/tokenizer.py``: a bounded JSON object whose tokens are strings)."""
    from lmforge.utils.tokenizer import read_tokenizer_config, special_token

    base = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    config = os.path.join(base, "tokenizer_config.json")
    info = read_tokenizer_config(base)
    template = info.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = os.path.join(base, TEMPLATE_FILE)
    if not template and os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{jinja} is not a readable text file: {exc}") from None
    if template is not None and not isinstance(template, str):
        raise DataError(
            f"{config}: chat_template must be a string (a Jinja template) or a list of {{name, template}} "
            f"objects, found {type(template).__name__}. Fix the file, or set train_dataset.dataloader.chat_template."
        )
    return template or None, special_token(info, "bos_token"), special_token(info, "eos_token")


def compile_template(template: str):
    """The template in jinja2's immutable sandbox (no attribute access to Python internals, no
    mutation of its arguments); syntax errors and what the sandbox refuses are ``DataError``."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise DataError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise DataError(f"the chat template is not a valid Jinja template: {exc}") from None


def render_template(template: Any, **context: Any) -> str:
    """Render a compiled template; an operation the sandbox refuses (a template reaching for Python
    internals) or a template error is a ``DataError``, never a traceback."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    try:
        return template.render(**context)
    except SecurityError as exc:
        raise DataError(
            f"the chat template tried an operation the {SANDBOX_REFUSAL} ({exc}); lmforge renders templates in "
            "jinja2's immutable sandbox. Use a template that only formats the messages."
        ) from None
    except TemplateError as exc:
        raise DataError(f"the chat template failed to render: {exc}") from None


class RowFormatter:
    """Turns rows into ``(ids int32, mask uint8)`` with a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Any, settings: FormatSettings) -> None:
        self.tokenizer = tokenizer
        self.s = settings
        self.template = compile_template(settings.chat_template) if settings.chat_template else None

    # -- pieces: (text, trained) ------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        return render_template(
            self.template,
            messages=messages,
            add_generation_prompt=generation,
            bos_token=self.s.bos_token,
            eos_token=self.s.eos_token,
        )

    def chat_pieces(self, messages: Any, where: str) -> list[tuple[str, bool]]:
        key = self.s.messages_key
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DataError(f"{where}: '{key}' must be a list of {{role, content}} turns.")
        for i, m in enumerate(messages):  # strings only: never "None" or a repr in the rendered text
            text_value(m["role"], where, f"{key}[{i}].role")
            text_value(m["content"], where, f"{key}[{i}].content")
        if self.template is None:
            if [m["role"] for m in messages] == ["user", "assistant"]:
                prompt = messages[0]["content"] + PLAIN_SEPARATOR  # strings: checked above
                return [(prompt, False), (messages[1]["content"], True)]
            raise DataError(
                f"{where}: a conversation needs a chat template: the tokenizer's tokenizer_config.json has "
                "none; set train_dataset.dataloader.chat_template (a Jinja template or 'chatml')."
            )
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            full = self._render(messages[: i + 1], False)
            if not full.startswith(done):
                raise DataError(
                    f"{where}: the chat template does not render a conversation as the concatenation of its "
                    "turns, so the assistant tokens cannot be located; use a template that does (e.g. chatml)."
                )
            if message["role"] == "assistant":
                header = self._render(messages[:i], True)
                if header.startswith(done) and full.startswith(header):
                    pieces.append((header[len(done) :], False))
                    pieces.append((full[len(header) :], True))
                else:
                    pieces.append((full[len(done) :], True))
            else:
                pieces.append((full[len(done) :], False))
            done = full
        if not any(m["role"] == "assistant" for m in messages):
            # Only assistant turns carry the loss: such a row trains nothing, and a data set of them
            # trained at loss 0 with zero gradients to the end without a word.
            raise DataError(
                f"{where}: '{key}' has no assistant turn (roles: "
                f"{', '.join(repr(m['role']) for m in messages) or 'none'}), so none of its tokens would be "
                "trained on: only the assistant turns carry the loss. Add the assistant's reply, or remove "
                "the record."
            )
        return pieces

    def pieces(self, row: dict[str, Any], where: str) -> list[tuple[str, bool]]:
        s = self.s
        if s.messages_key in row and row[s.messages_key] is not None:
            return self.chat_pieces(row[s.messages_key], where)
        prompt, response = _prompt_response(row, s, where)
        if prompt is not None:
            return self.chat_pieces(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], where
            )
        if s.text_key in row:
            return [(text_value(row[s.text_key], where, s.text_key), True)]
        raise DataError(
            f"{where} has neither '{s.text_key}' (text), '{s.messages_key}' (chat) nor '{s.prompt_key}'/"
            f"'{s.response_key}' columns (it has: {', '.join(sorted(row))}); set text_key / messages_key / "
            "prompt_key / response_key in train_dataset.dataloader."
        )

    def _checked_pieces(self, row: dict[str, Any], where: str) -> list[tuple[str, bool]]:
        # A template can still produce a lone surrogate (from a key it reads that we did not check).
        return [
            (check_unicode(text, where, "rendered text"), trained)
            for text, trained in self.pieces(row, where)
        ]

    # -- tokens ------------------------------------------------------------------------------
    def encode_rows(
        self, rows: list[tuple[int, dict[str, Any]]], source: str, locations: list[str] | None = None
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(row index, ids, mask)`` per row; one ``encode_batch`` call for all pieces of all rows.
        ``locations``: each row's place for error messages (``file:line``), else ``source row i``."""
        where = locations or [f"{source} row {i}" for i, _ in rows]
        all_pieces = [self._checked_pieces(row, at) for (_, row), at in zip(rows, where)]
        flat = [text for pieces in all_pieces for text, _ in pieces]
        encodings = self.tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
        out = []
        k = 0
        for (index, _), pieces in zip(rows, all_pieces):
            ids_parts, mask_parts = [], []
            for _, trained in pieces:
                ids = np.asarray(encodings[k].ids, dtype=np.int32)
                k += 1
                ids_parts.append(ids)
                mask_parts.append(np.full(ids.size, 1 if trained else 0, dtype=np.uint8))
            ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
            mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8)
            if ids.size == 0:
                out.append((index, ids, mask))  # empty documents are dropped by the packer
                continue
            ids = np.append(ids, np.int32(self.s.eod))
            mask = np.append(mask, mask[-1])
            out.append((index, ids, mask))
        return out


def _prompt_response(row: dict[str, Any], s: FormatSettings, where: str) -> tuple[str | None, str | None]:
    if s.prompt_key in row and s.response_key in row:
        return text_value(row[s.prompt_key], where, s.prompt_key), text_value(
            row[s.response_key], where, s.response_key
        )
    if "instruction" in row and "output" in row:  # Alpaca; a null or empty "input" means none
        instruction = text_value(row["instruction"], where, "instruction")
        extra = text_value(row["input"], where, "input") if row.get("input") is not None else ""
        return (f"{instruction}\n\n{extra}" if extra else instruction), text_value(
            row["output"], where, "output"
        )
    return None, None


# -- worker processes ---------------------------------------------------------------------------

_worker: RowFormatter | None = None


def init_worker(tokenizer_path: str, settings: FormatSettings) -> None:
    global _worker
    from lmforge.utils.tokenizer import load_tokenizer

    _worker = RowFormatter(load_tokenizer(tokenizer_path), settings)


def encode_in_worker(
    task: tuple[list[tuple[int, dict[str, Any]]], str, list[str] | None],
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    rows, source, locations = task
    assert _worker is not None
    return _worker.encode_rows(rows, source, locations)
