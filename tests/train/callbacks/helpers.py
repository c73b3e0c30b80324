"""A tiny language model and a minimal driver that calls callback hooks the way the trainer does."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """Embedding -> 2 linear blocks -> output; returns an object with .loss / .loss_sum / .num_tokens."""

    def __init__(self, vocab: int = 32, hidden: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(2))
        self.output_layer = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, input_ids, labels=None, loss_mask=None, **_: Any):
        self.calls += 1
        x = self.embedding.word_embeddings(input_ids)
        for layer in self.decoder.layers:
            x = torch.tanh(layer(x))
        logits = self.output_layer(x)
        out = SimpleNamespace(logits=logits)
        if labels is not None:
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
            valid = (labels.flatten() != -100).float()
            if loss_mask is not None:
                valid = valid * loss_mask.flatten().float()
            out.loss_sum = (ce * valid).sum()
            out.num_tokens = valid.sum()
            out.loss = out.loss_sum / out.num_tokens.clamp(min=1)
        return out


def micro_batches(
    n: int, batch: int = 2, seq: int = 8, vocab: int = 32, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": torch.roll(ids, -1, 1)})
    return out


@dataclass
class FakeState:
    global_step: int = 0
    consumed_samples: int = 0
    max_steps: int = 10
    global_batch_size: int = 4
    extra: dict = field(default_factory=dict)


@dataclass
class FakeResult:
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int = 32
    input_tokens: int = 32
    samples: int = 4
    aux_losses: dict = field(default_factory=dict)


def drive(callbacks, model, steps: int, micro: int = 2, optimizer=None, args=None, work=None):
    """Run ``steps`` steps of plain SGD-free training, calling the hooks in the trainer's order."""
    state = FakeState(max_steps=steps)
    kwargs = {"model": model, "optimizer": optimizer, "trainer": None}
    for cb in callbacks:
        cb.on_train_begin(args, state, **kwargs)
    all_metrics = []
    for step in range(steps):
        for cb in callbacks:
            cb.on_step_begin(args, state, **kwargs)
        losses = []
        for batch in micro_batches(micro, seed=step):
            out = model(**batch)
            (out.loss / micro).backward()
            losses.append(float(out.loss.detach()))
        if work is not None:
            work(step + 1)
        model.zero_grad(set_to_none=True)
        state.global_step += 1
        state.consumed_samples += state.global_batch_size
        loss = sum(losses) / micro
        metrics = {"step": state.global_step}
        result = FakeResult(loss=loss, grad_norm=1.0 + step, lr=1e-3 * (step + 1))
        for cb in callbacks:
            cb.on_step_end(
                args, state, loss=loss, grad_norm=result.grad_norm, result=result, metrics=metrics, **kwargs
            )
        all_metrics.append(metrics)
    for cb in callbacks:
        cb.on_train_end(args, state, **kwargs)
    return all_metrics
