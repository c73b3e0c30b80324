"""A tiny causal LM and an in-memory data loader that follow lmforge's model/data contracts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32
SEQ = 8


@dataclass
class TinyOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)


class TinyLM(nn.Module):
    """Embedding -> one tanh MLP layer -> output layer; token-level cross entropy with masking."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)
        self.poison = False  # tests set this to produce a NaN loss

    def forward(self, input_ids, labels=None, loss_mask=None, position_ids=None, **_: Any) -> TinyOutput:
        h = torch.tanh(self.hidden(self.embedding.word_embeddings(input_ids)))
        logits = self.output_layer(h)
        if self.poison:
            logits = logits * float("nan")
        if labels is None:
            return TinyOutput(logits)
        valid = labels != -100
        if loss_mask is not None:
            valid = valid & (loss_mask != 0)
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
        loss_sum = (ce * valid.flatten()).sum()
        n = valid.sum()
        return TinyOutput(logits, loss_sum / n.clamp(min=1), loss_sum, n)


class TinyLoader:
    """Deterministic synthetic token sequences; sample i is a function of (seed, i) only, so a
    loader built at ``consumed_samples`` continues exactly where another one stopped."""

    def __init__(
        self, consumed_samples: int = 0, local_batch_size: int = 2, seed: int = 0, masked: bool = True
    ):
        self.position = consumed_samples
        self.lbs = local_batch_size
        self.seed = seed
        self.masked = masked

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        step = 1 + i % 3
        tokens = (start + step * torch.arange(SEQ + 1)) % VOCAB  # learnable: arithmetic sequences
        mask = torch.ones(SEQ, dtype=torch.int64)
        if self.masked:
            mask[: i % 4] = 0  # uneven numbers of valid tokens per sample
        return tokens, mask

    def __iter__(self):
        while True:
            rows = [self.sample(self.position + j) for j in range(self.lbs)]
            self.position += self.lbs
            tokens = torch.stack([r[0] for r in rows])
            yield {
                "input_ids": tokens[:, :-1],
                "labels": tokens[:, 1:].clone(),
                "loss_mask": torch.stack([r[1] for r in rows]),
                "position_ids": torch.arange(SEQ).expand(self.lbs, SEQ),
            }

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
