"""Validation loss and perplexity.

The loss is the mean over every valid label token of all evaluated batches (on all data-parallel
ranks), like the training loss — not a mean of batch means — and covers the language-model loss
only (auxiliary MoE / MTP terms are training regularisers). Perplexity is ``exp(loss)``.

Evaluation must not change training: the model runs in eval mode under ``torch.no_grad`` and every
buffer (MoE token counters, expert-bias statistics, running max logits, ...) is restored afterwards.

Top-level keys of the YAML (``allow_extra`` keys of the original's ``TrainConfig``):

* ``eval_interval``: evaluate every this many optimizer steps (``0`` / absent: never);
* ``eval_steps``: micro-batches of ``training.local_batch_size`` samples per rank per evaluation
  (absent: the whole validation split);
* ``eval_dataset``: a section shaped like ``train_dataset`` whose ``valid`` split is used; absent:
  the ``valid`` split of ``train_dataset`` (``split``'s second part or ``valid_data_path``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config.schema import TrainConfig
from lmforge.errors import ConfigError

MODEL_INPUTS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "actual_seq_len")


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int  # valid label tokens evaluated (all ranks)
    batches: int  # micro-batches evaluated on this rank

    def as_metrics(self) -> dict[str, float]:
        return {"val_loss": self.loss, "val_ppl": self.perplexity, "val_tokens": float(self.tokens)}


@dataclass
class EvalSettings:
    interval: int  # 0: off
    steps: int | None  # None: whole split


def eval_settings(config: TrainConfig) -> EvalSettings:
    """``eval_interval`` / ``eval_steps`` of the typed configuration (``TrainConfig`` checked them at load,
    the one owner of their rule and message)."""
    return EvalSettings(interval=config.eval_interval, steps=config.eval_steps)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    max_batches: int | None = None,
    device: torch.device | None = None,
    group: Any = None,
    pipeline: Any = None,
) -> EvalResult:
    """Loss over ``batches`` (at most ``max_batches``); reduced over ``group`` when distributed.

    Under pipeline parallel ``pipeline`` (``ParallelContext.pipeline``) runs the stages forward-only.
    """
    device = device or _device_of(model)
    was_training = model.training
    saved = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    model.eval()
    try:
        for batch in batches:
            if max_batches is not None and count >= max_batches:
                break
            inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k in MODEL_INPUTS}
            if pipeline is not None:
                batch_loss, batch_tokens = pipeline.evaluate_batch(inputs)
            else:
                out = model(**inputs)
                batch_loss, batch_tokens = out.loss_sum.detach(), out.num_tokens
            loss_sum += batch_loss.to(torch.float64)
            tokens += torch.as_tensor(batch_tokens, device=device).to(torch.float64)
            count += 1
    finally:
        model.train(was_training)
        for name, buf in model.named_buffers():
            old = saved.get(name)
            if old is not None and old.shape == buf.shape:
                buf.copy_(old)
    if dist.is_available() and dist.is_initialized():
        totals = torch.stack([loss_sum, tokens])
        dist.all_reduce(totals, group=group)
        loss_sum, tokens = totals[0], totals[1]
    n = float(tokens)
    loss = float(loss_sum) / n if n > 0 else math.nan
    ppl = (
        math.exp(loss)
        if math.isfinite(loss) and loss < 700
        else math.inf
        if math.isfinite(loss)
        else math.nan
    )
    return EvalResult(loss=loss, perplexity=ppl, tokens=int(n), batches=count)


def build_eval_loader(config: TrainConfig, *, dp_rank: int = 0, dp_size: int = 1) -> Any:
    """The validation loader of ``eval_dataset`` (or ``train_dataset``) of the typed ``config``, or a
    ConfigError when empty."""
    from lmforge.data import build_dataloader  # data sits beside train's other building blocks

    section, key = config.eval_dataset, "eval_dataset"
    if section is None:
        section, key = config.train_dataset, "train_dataset"
    training, model = config.training, config.model
    loader = build_dataloader(
        section,
        local_batch_size=training.local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=training.seed,
        vocab_size=getattr(model, "vocab_size", None),
        seq_length=getattr(model, "seq_length", None),
        phase="valid",
    )
    if loader is None:
        raise ConfigError(
            f"evaluation needs a validation split, but {key} has none: give {key}.dataloader.config a split with "
            "a non-zero second part (e.g. split: '98,2,0'), or valid_data_path, or an eval_dataset section"
        )
    return loader
