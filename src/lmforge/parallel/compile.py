"""Regional compilation: ``torch.compile`` applied to each transformer block, from outside the model.

Each decoder layer (and MTP depth) is compiled in place with ``nn.Module.compile``, so parameter
names, state dicts and checkpoints are unchanged. It runs after tensor/context/expert parallel and
activation recompute have wrapped the blocks, and before FSDP2 shards them (torchtitan's order):
FSDP2's hooks are left out of the compiled graphs by dynamo, recompute's checkpoint wrapper is
compiled with its block. Compilation itself happens at the first forward and backward of each block;
``compile_seconds`` reads how long it took from dynamo's counters.

Shapes: with ``dynamic: null`` (the default) torch compiles for the first shape and, at the first
different shape, recompiles once with that dimension dynamic; later shapes reuse it. ``dynamic: true``
starts dynamic, ``false`` specialises on every shape (a recompile per new shape, up to dynamo's limit).
"""

from __future__ import annotations

import logging

from torch import nn

from lmforge.config.sections_speed import CompileConfig
from lmforge.models.common.layers import layer_modules

logger = logging.getLogger(__name__)


def compile_blocks(model: nn.Module, section: CompileConfig) -> int:
    """Compile every transformer block of ``model`` in place; returns how many were compiled."""
    blocks = layer_modules(model)
    options = {
        "backend": section.backend,
        "fullgraph": bool(section.fullgraph),
        "dynamic": section.dynamic,
    }
    if section.mode != "default":
        options["mode"] = section.mode
    for block in blocks:
        block.compile(**options)
    # The loss is one more region (at small widths it is much of the step): the output projection +
    # plain cross-entropy as a whole, or, for the chunked loss (the default), the softmax and logits'
    # gradient of each chunk (models/common/loss.py TokenLoss.compile).
    token_loss = getattr(model, "token_loss", None)
    if isinstance(token_loss, nn.Module):
        token_loss.compile(**options)
    logger.info(
        "compile: %d transformer blocks compiled with torch.compile(%s); compilation runs at the first step",
        len(blocks),
        ", ".join(f"{k}={v!r}" for k, v in options.items()),
    )
    return len(blocks)


def compile_seconds() -> float:
    """Seconds this process has spent compiling graphs so far, forward and backward (dynamo's accounting)."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))


class CompileWatch:
    """Logs the compile time after the first step, and every later step that compiled again."""

    def __init__(self) -> None:
        self.seconds = compile_seconds()
        self.steps = 0

    def after_step(self, step: int) -> float:
        """Seconds spent compiling during this step (logged when > 0)."""
        now = compile_seconds()
        spent, self.seconds = now - self.seconds, now
        self.steps += 1
        if self.steps == 1:
            logger.info("compile: %.1f s compiling the transformer blocks during step %d", spent, step)
        elif spent > 0:
            logger.info(
                "compile: recompiled during step %d (%.1f s; a new input shape or a guard failed)",
                step,
                spent,
            )
        return spent
