"""Swap (activation offload) as a visible part of the module: the ``Swapped<Class>`` wrapper.

Swap makes a layer (``layer_swap``) or a submodule (``op_swap``) a :class:`Swapped` one, whose forward
runs in ``torch.autograd.graph.saved_tensors_hooks`` that move saved activations to pinned CPU memory
on a side stream and fetch them back in backward, ``default_prefetch`` swapped layers ahead. On a CPU
run the "move" is a no-op, but the bookkeeping is identical, so what is swapped can still be measured
as bytes no longer kept by autograd on the compute device (:func:`count_saved_activation_bytes`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.parallel.activation_wrappers import ActivationWrapper, wrap_module


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (a DTensor's local shard); None for tensors without one."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        t = t.to_local()
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None  # wrapper subclasses and other storage-less tensors


class _SwappedTensor:
    """One saved activation that lives off the compute device between forward and backward."""

    __slots__ = ("__weakref__", "device", "host", "event", "fetched", "nbytes")

    def __init__(self, device: torch.device, host: torch.Tensor, event: Any, nbytes: int) -> None:
        self.device = device
        self.host = host  # on CPU for CUDA runs; the tensor itself on a CPU run
        self.event = event  # CUDA event of the last copy on the swap stream (None on CPU)
        self.fetched: torch.Tensor | None = None
        self.nbytes = nbytes


class ActivationSwap:
    """Saved-tensor hooks that offload activations of chosen layers / modules to the CPU.

    ``prefetch``: when backward first needs layer L's activations, the copies back of the next
    ``prefetch`` swapped layers below L (the ones backward reaches next) are started on the side
    stream, so they overlap with L's backward compute.
    """

    def __init__(self, prefetch: int = 1) -> None:
        self.prefetch = prefetch
        self.swapped_bytes = 0  # total bytes packed by the hooks (a statistic)
        self.fetches_started: list[int] = []  # layer ids whose fetch was started, in order (diagnostic)
        self._records: dict[int, list[weakref.ref[_SwappedTensor]]] = {}
        self._fetched_layers: set[int] = set()  # copies back started (this backward)
        self._visited_layers: set[int] = set()  # backward has unpacked from these
        self._stream: Any = None

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._records)

    def register_layer(self, layer_id: int) -> None:
        self._records.setdefault(layer_id, [])

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    @contextlib.contextmanager
    def offload(self, layer_id: int, keep: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the block, saved tensors are swapped, except those sharing storage with ``keep``
        (parameters and the block's inputs, which stay alive anyway)."""
        keep_ptrs = {_storage_ptr(t) for t in keep if isinstance(t, torch.Tensor)}
        records = self._records.setdefault(layer_id, [])
        # A new forward of this layer starts a new generation of activations.
        records[:] = [r for r in records if r() is not None]
        self._fetched_layers.discard(layer_id)
        self._visited_layers.discard(layer_id)

        def pack(t: torch.Tensor) -> Any:
            ptr = _storage_ptr(t)
            if ptr is None or ptr in keep_ptrs or t.layout != torch.strided or t.numel() == 0:
                return t
            nbytes = t.untyped_storage().nbytes()
            if t.device.type == "cuda":
                stream = self._side_stream(t.device)
                # Pinned, so the copy is asynchronous; contiguous, as torch's own save_on_cpu does.
                host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=True)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(stream):
                    host.copy_(t, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                # The device memory may only be reused once the copy on the side stream is done.
                t.record_stream(stream)
                record = _SwappedTensor(t.device, host, event, nbytes)
            else:
                record = _SwappedTensor(t.device, t, None, nbytes)
            self.swapped_bytes += nbytes
            records.append(weakref.ref(record))
            return (layer_id, record)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            lid, record = packed
            if lid not in self._visited_layers:
                # Backward reached this layer: make sure its own copies are under way, and start
                # those of the next ``prefetch`` swapped layers it will reach after this one.
                self._visited_layers.add(lid)
                for wanted in (lid, *self._next_layers_below(lid)):
                    if wanted not in self._fetched_layers:
                        self._fetched_layers.add(wanted)
                        self._start_fetch(wanted)
            if record.fetched is None:  # a tensor packed after its layer's fetch (or a retained graph)
                self._fetch_one(record)
            tensor = record.fetched
            if record.event is not None:
                current = torch.cuda.current_stream(record.device)
                current.wait_event(record.event)
                tensor.record_stream(current)
            record.fetched = None  # autograd holds it now; drop ours so memory frees after use
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _next_layers_below(self, layer_id: int) -> list[int]:
        below = [lid for lid in sorted(self._records, reverse=True) if lid < layer_id]
        return below[: self.prefetch]

    def _start_fetch(self, layer_id: int) -> None:
        self.fetches_started.append(layer_id)
        for ref in self._records.get(layer_id, []):
            record = ref()
            if record is not None and record.fetched is None:
                self._fetch_one(record)

    def _fetch_one(self, record: _SwappedTensor) -> None:
        if record.device.type != "cuda":
            record.fetched = record.host
            return
        stream = self._side_stream(record.device)
        with torch.cuda.stream(stream):
            record.fetched = record.host.to(record.device, non_blocking=True)
            record.event = torch.cuda.Event()
            record.event.record(stream)


class Swapped(ActivationWrapper):
    """The tensors autograd saves inside the module's forward are offloaded by ``swapper`` (its
    ``saved_tensors_hooks``) under ``swap_layer_id``; parameters, buffers and inputs stay where they are."""

    wrapper_name = "Swapped"
    swapper: ActivationSwap
    swap_layer_id: int

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        self.activation_ran = True
        keep = [*self.parameters(), *self.buffers()]
        keep += [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        with self.swapper.offload(self.swap_layer_id, keep):
            return inner(*args, **kwargs)


def swap_module(module: nn.Module, swapper: ActivationSwap, layer_id: int) -> None:
    """Offload the activations saved inside ``module``'s forward (parameter names do not change)."""
    if not wrap_module(module, Swapped):
        return
    swapper.register_layer(layer_id)
    module.swapper = swapper
    module.swap_layer_id = layer_id


@contextlib.contextmanager
def count_saved_activation_bytes(model: nn.Module | None = None) -> Iterator[dict[str, int]]:
    """Count the bytes autograd keeps for backward on the compute device while the block runs.

    Each distinct storage is counted once; parameters and buffers of ``model`` are not activations
    and are left out. Tensors that a recompute or swap region packs with its own (inner) hooks never
    reach these hooks, which is exactly the memory those features save.
    """
    exclude = set()
    if model is not None:
        exclude = {_storage_ptr(t) for t in (*model.parameters(), *model.buffers())}
    seen: set[int] = set()
    result = {"bytes": 0, "tensors": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = _storage_ptr(t)
        if ptr is not None and t.layout == torch.strided and ptr not in exclude and ptr not in seen:
            seen.add(ptr)
            result["bytes"] += t.untyped_storage().nbytes()
            result["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
