"""The numbered layers of a model: the one place that finds them.

FSDP's units, tensor parallel's per-layer plans, regional compilation, and recompute / swap (which
name layers by id) all ask :func:`numbered_layers`. A layer is a child of the outermost ``ModuleList`` /
``ModuleDict`` named ``layers`` (Megatron's ``decoder.layers.N``); its id is its key, so a pipeline
stage that holds layers 4..7 keeps ids 4..7. Containers whose path mentions ``mtp`` hold the
multi-token-prediction depths, numbered after the decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class NumberedLayer:
    layer_id: int  # global id: decoder layer i -> i; MTP depth i -> num_layers + i
    name: str  # qualified name in the model, e.g. "decoder.layers.3"
    module: nn.Module
    is_mtp: bool = False


def numbered_layers(model: nn.Module, num_layers: int | None = None) -> list[NumberedLayer]:
    """The decoder layers and, after them, the MTP depths of ``model``, in id order.

    ``num_layers``: the decoder layers of the whole model (a pipeline stage may hold fewer), the
    offset of the MTP ids; by default one past the highest decoder id found.
    """
    decoder: list[NumberedLayer] = []
    mtp: list[NumberedLayer] = []
    for path, container in model.named_modules():
        if path.rsplit(".", 1)[-1] != "layers" or not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        is_mtp = "mtp" in path
        target = mtp if is_mtp else decoder
        for key, child in container.named_children():
            if key.isdigit():
                target.append(NumberedLayer(int(key), f"{path}.{key}", child, is_mtp))
    # Only the outermost containers count; a "layers" list inside a layer does not.
    decoder, mtp = _outermost(decoder), _outermost(mtp)
    offset = num_layers if num_layers is not None else (max((d.layer_id for d in decoder), default=-1) + 1)
    for d in mtp:
        d.layer_id += offset
    return sorted(decoder + mtp, key=lambda d: d.layer_id)


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of :func:`numbered_layers`, in order (FSDP's, TP's and compilation's unit)."""
    return [layer.module for layer in numbered_layers(model)]


def _outermost(layers: list[NumberedLayer]) -> list[NumberedLayer]:
    names = [d.name for d in layers]
    return [
        d for d in layers if not any(d.name.startswith(other + ".") for other in names if other != d.name)
    ]
