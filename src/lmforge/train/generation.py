"""Sampling text from a causal LM (no KV cache: the small models lmforge generates with on the
command line recompute the context each token, which keeps this independent of the model code)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``logits`` with the tokens outside top-k and outside the nucleus of mass ``top_p`` at -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p`` (a token
    is dropped when the tokens more likely than it already hold ``top_p``); the most likely token is
    always kept."""
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs, order = torch.sort(torch.softmax(logits, dim=-1), descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        drop = before >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _ends_with(ids: list[int], stops: Sequence[Sequence[int]]) -> int:
    """The length of the stop sequence ``ids`` ends with (0: none)."""
    for stop in stops:
        if stop and len(ids) >= len(stop) and ids[-len(stop) :] == list(stop):
            return len(stop)
    return 0


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    context_length: int | None = None,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt_ids``; temperature 0 means greedy. Returns only the new tokens, ending with
    ``eos_id`` or a stop sequence when one ended the generation."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids if context_length is None else ids[:, -context_length:]
            logits = model(context).logits[0, -1].float()
            if temperature <= 0:
                next_id = int(torch.argmax(logits))
            else:
                logits = filter_logits(logits / temperature, top_k, top_p)
                probs = torch.softmax(logits, dim=-1)
                next_id = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            new.append(next_id)
            if (eos_id is not None and next_id == eos_id) or _ends_with(new, stop_sequences):
                break
            ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    finally:
        model.train(was_training)
    return new


def chat_prompt_text(
    messages: list[dict], template: str | None, bos: str = "", eos: str = ""
) -> tuple[str, str]:
    """(the prompt that asks for the assistant's turn, the text that ends such a turn) for ``messages``.

    With a template: the conversation rendered with ``add_generation_prompt``, and the end-of-turn
    marker the template writes after an assistant message's content (``<|im_end|>`` for ChatML;
    empty when the template writes none). Without one, training formats a prompt/response row as the
    prompt, ``PLAIN_SEPARATOR``, the response: one user turn becomes the same prompt, with no marker.
    """
    from lmforge.data.text_format import PLAIN_SEPARATOR, compile_template, render_template
    from lmforge.errors import ConfigError

    if template is None:
        if [m.get("role") for m in messages] != ["user"]:
            raise ConfigError(
                "a conversation other than one user message needs a chat template: none is in the run's config "
                "or with the tokenizer; give one with --chat-template FILE."
            )
        return str(messages[0]["content"]) + PLAIN_SEPARATOR, ""
    compiled = compile_template(template)
    context = {"bos_token": bos, "eos_token": eos}
    prompt = render_template(compiled, messages=messages, add_generation_prompt=True, **context)
    probe = "\x00lmforge-probe\x00"
    answered = render_template(
        compiled,
        messages=[*messages, {"role": "assistant", "content": probe}],
        add_generation_prompt=False,
        **context,
    )
    marker = answered.split(probe, 1)[1] if probe in answered else ""
    return prompt, marker.strip()
