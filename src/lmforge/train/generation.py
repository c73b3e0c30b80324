"""Sampling text from a causal LM (no KV cache: the small models lmforge generates with on the
command line recompute the context each token, which keeps this independent of the model code)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    context_length: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt_ids``; temperature 0 means greedy. Returns only the new tokens."""
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
                logits = logits / temperature
                if top_k is not None and 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            new.append(next_id)
            if eos_id is not None and next_id == eos_id:
                break
            ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    finally:
        model.train(was_training)
    return new
