"""Reading checkpoints that earlier lmforge versions wrote. Removed in lmforge 0.3.

The load path (``train/checkpoint/load.py``) asks :func:`detect_older_formats` once, which names what it
finds in a log line; everything else about those formats lives here, so that removing this package
removes their support and nothing else:

* weight layout 1 of the fused projections (``common.json`` without ``weight_layout``):
  ``fused_layout_v1.py`` permutes weights, LoRA ``B`` and optimizer state into the current layout;
* bf16 weights with fp32 masters in the optimizer state (the former single-device path):
  ``single_device_masters.py`` loads the masters into the fp32 parameters;
* no ``optimizer_type`` in ``common.json``: the optimizer is compared by its per-parameter state names;
* pickled state skeletons (before JSON skeletons): ``pickled_skeleton.py``, reached from
  ``safe_load.decode_skeleton``.

To carry such a checkpoint past 0.3, load it with this version and save it again (resume for one step, or
``lmforge convert --to-hf`` for the weights): a save writes the current format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.models.common.fused_layout import WEIGHT_LAYOUT
from lmforge.train.checkpoint.compat.fused_layout_v1 import upgrade_fused_layout
from lmforge.train.checkpoint.compat.single_device_masters import (
    MASTER_STATE,
    load_masters,
    masters_in_optimizer,
)
from lmforge.train.checkpoint.resolve import CheckpointHeader
from lmforge.train.checkpoint.state_dicts import Checkpointable, _optimizer_options
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

REMOVED_IN = "0.3"


@dataclass
class OlderFormats:
    """What about one checkpoint predates the current format, and how to convert it after loading."""

    header: CheckpointHeader
    keys: Any
    weight_layout: int = WEIGHT_LAYOUT
    masters: list[str] = field(default_factory=list)
    optimizer_type_recorded: bool = True

    @property
    def names(self) -> list[str]:
        found = []
        if self.weight_layout != WEIGHT_LAYOUT:
            found.append(f"fused weight layout {self.weight_layout}")
        if self.masters:
            found.append("bf16 weights with fp32 masters in the optimizer state (the old single-device path)")
        if not self.optimizer_type_recorded:
            found.append("no optimizer_type in common.json")
        return found

    def saved_optimizer(self, target: Checkpointable, optimizer_format: str) -> str | None:
        """For a checkpoint that did not record its optimizer type: a description of it when its
        per-parameter state names differ from the live optimizer's (this rank's parameters), else None."""
        if self.optimizer_type_recorded or optimizer_format not in ("fqn", "fqn_flat"):
            return None
        saved, live = _state_names(self.keys, "optimizer.state."), _live_state_names(target)
        if live and any(saved.get(p, set()) != s for p, s in live.items()):
            return "an optimizer with other per-parameter states"
        return None

    def upgrade(self, target: Checkpointable, adapters_only: bool) -> None:
        """After the current format's load: masters into the parameters, then the fused rows permuted."""
        if self.masters:
            load_masters(self.header.path, target, self.masters)
        if self.weight_layout != WEIGHT_LAYOUT:
            upgrade_fused_layout(
                target.model, target.optimizer, self.weight_layout, self.header.path, adapters_only
            )


def detect_older_formats(header: CheckpointHeader, keys: Any, model_names: Any) -> OlderFormats:
    """The older formats of checkpoint ``header`` (DCP ``keys``), named in a log line when there are any."""
    older = OlderFormats(
        header,
        keys,
        weight_layout=int(header.common.get("weight_layout", WEIGHT_LAYOUT)),
        masters=masters_in_optimizer(model_names, keys),
        optimizer_type_recorded=header.common.get("optimizer_type") is not None
        or not any(k.startswith("optimizer.") for k in keys),
    )
    if older.names:
        logger.warning(
            "Checkpoint %s was written by an earlier lmforge (%s): converting on load through "
            "train/checkpoint/compat, which is removed in lmforge %s. Saves from now on write the current format.",
            header.path,
            "; ".join(older.names),
            REMOVED_IN,
        )
    return older


def _state_names(keys: Any, prefix: str) -> dict[str, set[str]]:
    """parameter name -> names of its optimizer states, from DCP keys ``<prefix><param>.<state>``."""
    out: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(prefix):
            param, _, state = key[len(prefix) :].rpartition(".")
            if state != MASTER_STATE:  # the old single-device path's masters are loaded into the weights
                out.setdefault(param, set()).add(state)
    return out


def _live_state_names(target: Checkpointable) -> dict[str, set[str]]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    flat = get_optimizer_state_dict(target.model, target.optimizer, options=_optimizer_options("fqn_flat"))
    return _state_names(flat, "state.")
