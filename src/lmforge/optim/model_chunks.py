"""Several pipeline chunks held by one rank, seen by the optimizer as one model.

Names stay unprefixed (``decoder.layers.3...``), so the name rules of the section (weight decay,
``lr_scale``, ``adamw_include``) apply to every chunk alike, and the optimizer hooks are merged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

from lmforge.utils.qk_clip import QKClipLayer


class ModelChunks:
    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        self.chunks = list(chunks)

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for chunk in self.chunks:
            for name, p in chunk.named_parameters(remove_duplicate=remove_duplicate):
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _union(self, attr: str) -> list:
        out: list = []
        for chunk in self.chunks:
            fn = getattr(chunk, attr, None)
            if callable(fn):
                out.extend(fn())
        return out

    def no_weight_decay_names(self) -> set[str]:
        return set(self._union("no_weight_decay_names")) | set(self._union("no_weight_decay"))

    def no_weight_decay_keywords(self) -> list[str]:
        return self._union("no_weight_decay_keywords")

    def muon_split_schema(self) -> dict[str, tuple[int, list[int]]]:
        schema: dict[str, tuple[int, list[int]]] = {}
        for chunk in self.chunks:
            fn = getattr(chunk, "muon_split_schema", None)
            if callable(fn):
                schema.update(fn())
        return schema

    def qk_clip_layers(self) -> list[QKClipLayer]:
        return self._union("qk_clip_layers")

    def reset_max_logits(self) -> None:
        for chunk in self.chunks:
            fn = getattr(chunk, "reset_max_logits", None)
            if callable(fn):
                fn()

    @property
    def track_max_logits(self) -> bool:
        return any(getattr(c, "track_max_logits", False) for c in self.chunks)

    @track_max_logits.setter
    def track_max_logits(self, value: bool) -> None:
        for chunk in self.chunks:
            if hasattr(chunk, "track_max_logits"):
                chunk.track_max_logits = value

    def to(self, *args, **kwargs) -> ModelChunks:  # pragma: no cover - convenience for tests
        for chunk in self.chunks:
            chunk.to(*args, **kwargs)
        return self


def as_model(model: nn.Module | Sequence[nn.Module]) -> nn.Module | ModelChunks:
    if isinstance(model, list | tuple):
        return model[0] if len(model) == 1 else ModelChunks(model)
    return model


__all__ = ["ModelChunks", "as_model"]
