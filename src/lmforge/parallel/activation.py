"""Activation memory: recompute (full / select / exclude_op), communication recompute and swap.

The YAML sections ``recompute``, ``recompute_comm`` and ``swap`` name decoder layers by layer specs
(``'0-3'``, ``'5'``) and submodules by name patterns (the one rule of
:mod:`lmforge.utils.name_patterns`: exact, part with aliases, glob or regular expression) matched
against the dotted path of every submodule of a decoder layer. Unlike the original (which only applies them when
the world size is above one) they apply on one device too.

* Recompute makes a module a :class:`Recomputed` one, whose forward runs the original under
  non-reentrant ``torch.utils.checkpoint``. Like torch's ``fully_shard``, the wrapper is a subclass
  of the module's own class (``RecomputedTransformerLayer``), so it shows in ``print(model)`` while
  the module stays in place: parameter names, state_dict keys, optimizer name patterns and FSDP are
  unaffected (no ``_checkpoint_wrapped_module`` segment, no method assigned to the instance).
  ``exclude_op`` turns this into selective activation checkpointing: ops whose name contains an
  entry are saved (``MUST_SAVE``), everything else is recomputed.
* Communication recompute checkpoints the matched modules with a policy that saves every op except
  the collectives (``_c10d_functional`` / ``c10d`` ops), which are re-run in backward.
* Swap makes a layer (``layer_swap``) or a submodule (``op_swap``) a :class:`Swapped` one, whose
  forward runs in ``torch.autograd.graph.saved_tensors_hooks`` that move saved activations to pinned
  CPU memory on a side stream and fetch them back in backward, ``default_prefetch`` swapped layers
  ahead. On a CPU run the "move" is a no-op, but the bookkeeping is identical, so what is swapped
  can still be measured as bytes no longer kept by autograd on the compute device.

Recompute and swap only change where activations live, never the arithmetic: gradients are bitwise
identical to a run without them (the recomputed forward re-runs the same kernels with the same RNG
state).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lmforge.config.load import as_section
from lmforge.errors import ConfigError
from lmforge.utils.name_patterns import NamePattern

# The spec's examples use MindSpore-Transformers graph-mode names ("attention"); lmforge models use
# Megatron names ("self_attention"). A pattern may use either: each path is also offered with these
# components renamed.
_PATH_ALIASES = {"self_attention": "attention"}

# Collective ops as they appear under the dispatcher (functional collectives used by DTensor, and the
# c10d ops used by explicit process-group calls).
_COMM_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")


# --------------------------------------------------------------------------------------------------
# Decoder layers and their submodule paths
# --------------------------------------------------------------------------------------------------


@dataclass
class DecoderLayer:
    layer_id: int  # global id: decoder layer i -> i; MTP layer i -> num_layers + i
    name: str  # qualified name in the model, e.g. "decoder.layers.3"
    module: nn.Module


def find_decoder_layers(model: nn.Module, num_layers: int | None = None) -> list[DecoderLayer]:
    """The decoder layers (and MTP layers after them) of ``model``, by global layer id.

    A decoder layer is a child of a ``ModuleList`` / ``ModuleDict`` named ``layers`` (Megatron's
    ``decoder.layers.N``); its id is its key, so a pipeline stage that holds layers 4..7 keeps ids
    4..7. Containers whose path mentions ``mtp`` hold MTP layers, numbered after ``num_layers``.
    """
    decoder: list[DecoderLayer] = []
    mtp: list[DecoderLayer] = []
    for path, container in model.named_modules():
        if path.rsplit(".", 1)[-1] != "layers" or not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        is_mtp = "mtp" in path
        target = mtp if is_mtp else decoder
        for key, child in container.named_children():
            if not key.isdigit():
                continue
            inner = getattr(child, "transformer_layer", None)
            if is_mtp and isinstance(inner, nn.Module):
                # An MTP block is called piecewise (projection, then its transformer layer), never
                # as a whole: its transformer layer is what runs as "the layer".
                target.append(DecoderLayer(int(key), f"{path}.{key}.transformer_layer", inner))
            else:
                target.append(DecoderLayer(int(key), f"{path}.{key}", child))
        # Only the first (outermost) decoder container counts; nested "layers" inside a layer do not.
    decoder = _outermost(decoder)
    mtp = _outermost(mtp)
    offset = num_layers if num_layers is not None else (max((d.layer_id for d in decoder), default=-1) + 1)
    for d in mtp:
        d.layer_id += offset
    return sorted(decoder + mtp, key=lambda d: d.layer_id)


def _outermost(layers: list[DecoderLayer]) -> list[DecoderLayer]:
    names = [d.name for d in layers]
    return [
        d for d in layers if not any(d.name.startswith(other + ".") for other in names if other != d.name)
    ]


def layer_module_paths(layer: DecoderLayer) -> list[str]:
    """Dotted paths of every submodule of a decoder layer, relative to the layer."""
    return [path for path, _ in layer.module.named_modules() if path]


def _path_forms(layer: DecoderLayer, rel_path: str) -> list[str]:
    """The strings a pattern is matched against for one submodule.

    The path relative to the layer (``self_attention.linear_qkv``), relative to the decoder
    (``layers.3.self_attention.linear_qkv``, the form of the original's DeepSeek-V4 example) and
    the full model path, each also with the graph-mode aliases of :data:`_PATH_ALIASES`.
    """
    container_key = "layers." + layer.name.rsplit("layers.", 1)[-1]  # "layers.3"
    forms = [rel_path, f"{container_key}.{rel_path}", f"{layer.name}.{rel_path}"]
    aliased = []
    for form in forms:
        parts = [_PATH_ALIASES.get(p, p) for p in form.split(".")]
        alias = ".".join(parts)
        if alias != form:
            aliased.append(alias)
    return forms + aliased


def _compile_pattern(pattern: Any, label: str) -> NamePattern:
    # One rule for every name pattern (lmforge.utils.name_patterns): exact, part (with aliases such as
    # attention.qkv), glob or regular expression.
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{label}: a module pattern must be a non-empty string, got {pattern!r}")
    return NamePattern(pattern)


def _match_modules(
    layer: DecoderLayer, regex: NamePattern, skip_under: set[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """Submodules of ``layer`` whose path matches; a child of a matched module is not listed again."""
    matched: list[tuple[str, nn.Module]] = []
    taken = set(skip_under or ())
    for rel_path, module in layer.module.named_modules():
        if not rel_path:
            continue
        if any(rel_path == t or rel_path.startswith(t + ".") for t in taken):
            continue
        if any(regex.fullmatch(form) for form in _path_forms(layer, rel_path)):
            matched.append((rel_path, module))
            taken.add(rel_path)
    return matched


def _no_match_error(label: str, pattern: str, layers: list[DecoderLayer]) -> ConfigError:
    paths = layer_module_paths(layers[0]) if layers else []
    shown = ", ".join(paths[:60]) + (", ..." if len(paths) > 60 else "")
    return ConfigError(
        f"{label}: the pattern {pattern!r} matches no submodule of the selected decoder layers. A pattern "
        "matches a submodule's dotted path (relative to the layer, e.g. 'self_attention.linear_qkv', to the "
        "decoder, 'layers.0.self_attention', or to the model) when it is the path or a part of it, when its "
        "dotted parts are parts of the path ('attention' = 'self_attention', 'qkv' = 'linear_qkv', 'proj' = "
        "'linear_proj', 'fc1'/'fc2' = 'linear_fc1'/'linear_fc2'), or as a shell glob or a regular expression "
        f"matching the whole path (docs/config.md#name-patterns). Available paths in layer "
        f"{layers[0].layer_id if layers else '?'}: {shown or '(none)'}"
    )


# --------------------------------------------------------------------------------------------------
# Layer specs
# --------------------------------------------------------------------------------------------------


def _layers_of(specs: Any, label: str, num_layers: int) -> list[int]:
    """Layer ids named by a spec list, validated as in the original (§1.4)."""
    from lmforge.config.layer_spec import check_layer_range, parse_layer_specs

    if specs is None:
        raise ConfigError(f"{label} is required here: a list of layer specs such as ['0-3'] or ['0', '5']")
    try:
        ranges = parse_layer_specs(specs, label)
        check_layer_range(ranges, list(specs), num_layers, label)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return [layer for lo, hi in ranges for layer in range(lo, hi + 1)]


def _module_specs(value: Any, label: str) -> list[tuple[str, Any]]:
    """``select_module`` as ``(pattern, specs)`` pairs.

    The original's type is ``dict | list``. A mapping is ``{pattern: [specs]}``; a list may hold such
    mappings or bare pattern strings (meaning every layer).
    """
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [(str(k) if not isinstance(k, str) else k, v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        pairs: list[tuple[str, Any]] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                pairs.append((item, None))
            elif isinstance(item, Mapping):
                pairs.extend(item.items())
            else:
                raise ConfigError(
                    f"{label}[{i}] must be a pattern string or a mapping {{pattern: [layer specs]}}, got {item!r}"
                )
        return pairs
    raise ConfigError(f"{label} must be a mapping {{module pattern: [layer specs]}}, got {value!r}")


# --------------------------------------------------------------------------------------------------
# Recompute
# --------------------------------------------------------------------------------------------------


def _exclude_op_policy(exclude_op: Sequence[str]) -> Callable[..., CheckpointPolicy]:
    needles = [str(e).lower() for e in exclude_op if str(e)]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = str(op).lower()
        if any(n in name for n in needles):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _is_comm_op(op: Any) -> bool:
    namespace = getattr(op, "namespace", None)
    if namespace is None:
        namespace = str(op).split(".", 1)[0]
    return namespace in _COMM_NAMESPACES


# Ops that only move data (no arithmetic) and save nothing of their input for backward.
_DATA_MOVEMENT = {"cat", "stack", "index_select", "index", "clone", "_unsafe_view", "contiguous"}


def _schema_kind(op: Any) -> tuple[bool, bool]:
    """(is a view: its output aliases an input without writing it, mutates an input)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False, False
    mutates = bool(schema.is_mutable)
    is_view = not mutates and any(r.alias_info is not None for r in schema.returns)
    return is_view, mutates


def _moves_pending_collective(op: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``op`` only moves (views, concatenates, indexes) a functional collective's result that
    nobody has waited for yet (torch's ``AsyncCollectiveTensor``, e.g. what ``all_to_all_single_autograd``
    returns; a view of it stays pending, the first other op waits for it)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_leaves

    is_view, _ = _schema_kind(op)
    name = getattr(getattr(op, "overloadpacket", None), "__name__", "")
    if not (is_view or name in _DATA_MOVEMENT):
        return False
    return any(isinstance(a, AsyncCollectiveTensor) for a in tree_leaves((args, kwargs)))


def _builds_in_place(op: Any, args: Any, kwargs: Any) -> bool:
    """A tensor factory (no tensor input: ``zeros``, ``full``, ``arange``), a view or an in-place op: the
    pieces of "make a buffer, fill part of it in place" (e.g. the causal bias of
    ``parallel/cp.lower_right_causal_attention``). Kept, the factory's or the view's cached output would be
    mutated afterwards, which torch's selective checkpoint refuses in backward ("Tensor cached during
    selective activation checkpoint has been mutated"); re-run, they cost no arithmetic worth keeping."""
    from torch.utils._pytree import tree_leaves

    is_view, mutates = _schema_kind(op)
    if is_view or mutates:
        return True
    return not any(isinstance(a, torch.Tensor) for a in tree_leaves((args, kwargs)))


def _comm_recompute_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Re-run the collectives in backward; keep the output of every op that computes, so compute is not
    repeated.

    Also re-run: data movement applied to a collective's pending result (Ulysses' ``unbind`` and ``cat``
    after its all-to-all). Kept instead, it would feed the backward nothing, so the replayed collective
    would never be waited on (torch's "unwaited collective calls" warning at exit, 32 per rank in the
    Ulysses parity run) and its cached views would pin the first result. An op that computes from the
    result (a matmul, a product) keeps its output and saves the replayed result as its backward input,
    which waits for it there. And tensor factories, views and in-place ops (:func:`_builds_in_place`).
    """
    if _is_comm_op(op) or _moves_pending_collective(op, args, kwargs) or _builds_in_place(op, args, kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


class ActivationWrapper:
    """Base of the activation wrappers: a module whose class gained one of them (see :func:`wrap_module`).

    ``activation_ran`` becomes True the first time the wrapped forward runs with autograd on; a model
    that calls a wrapped module's parts directly never runs it, which the plan reports.
    """

    wrapper_name = ""
    activation_ran = False


class Recomputed(ActivationWrapper):
    """The module's forward runs under non-reentrant ``torch.utils.checkpoint``: its activations are
    recomputed in backward instead of kept. ``recompute_context_fn`` (selective checkpointing) makes the
    ops its policy marks ``MUST_SAVE`` keep their outputs."""

    wrapper_name = "Recomputed"
    recompute_context_fn: Callable[[], Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # the wrapped class's forward, bound to this module
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        self.activation_ran = True
        extra = {"context_fn": self.recompute_context_fn} if self.recompute_context_fn is not None else {}
        # preserve_rng_state (default) replays dropout masks exactly.
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)


_WRAPPED_CLASSES: dict[tuple[type, type], type] = {}


def wrap_module(module: nn.Module, wrapper: type[ActivationWrapper]) -> bool:
    """Give ``module`` the behaviour of ``wrapper`` (``Recomputed`` / ``Swapped``); False if it has it.

    As torch's ``fully_shard`` does, the module's class becomes a subclass ``<Wrapper><Class>`` whose
    forward runs the original one: the module stays where it is, so parameter names, state_dict keys,
    hooks and ``isinstance`` checks are unchanged, and ``print(model)`` / ``isinstance(m, Recomputed)``
    show what was applied. No method is assigned to the instance. The class is made once per pair.
    """
    if isinstance(module, wrapper):
        return False
    base = type(module)
    cls = _WRAPPED_CLASSES.get((wrapper, base))
    if cls is None:
        name = f"{wrapper.wrapper_name}{base.__name__}"
        cls = type(name, (wrapper, base), {"__module__": base.__module__, "__qualname__": name})
        _WRAPPED_CLASSES[(wrapper, base)] = cls
    module.__class__ = cls
    return True


def is_recomputed(module: nn.Module) -> bool:
    return isinstance(module, Recomputed)


def is_swapped(module: nn.Module) -> bool:
    return isinstance(module, Swapped)


def recompute_module(module: nn.Module, policy: Callable[..., CheckpointPolicy] | None = None) -> None:
    """Make ``module`` recompute its forward in backward instead of keeping its activations.

    With ``policy`` the checkpoint is selective: ops the policy marks ``MUST_SAVE`` keep their outputs.
    A module that is already recomputed keeps its first policy.
    """
    if not wrap_module(module, Recomputed):
        return
    if policy is not None:
        module.recompute_context_fn = functools.partial(create_selective_checkpoint_contexts, policy)


# --------------------------------------------------------------------------------------------------
# Swap (activation offload)
# --------------------------------------------------------------------------------------------------


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
        self.swapped_bytes = 0  # total bytes packed by the hooks since the last reset (a statistic)
        self.fetches_started: list[int] = []  # layer ids whose fetch was started, in order (diagnostic)
        self._records: dict[int, list[weakref.ref[_SwappedTensor]]] = {}
        self._fetched_layers: set[int] = set()  # copies back started (this backward)
        self._visited_layers: set[int] = set()  # backward has unpacked from these
        self._stream: Any = None

    def reset_stats(self) -> None:
        self.swapped_bytes = 0
        self.fetches_started.clear()

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


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


@dataclass
class ActivationPlan:
    """What was applied (for the start-of-run log and for tests)."""

    full_layers: list[int] = field(default_factory=list)
    select: dict[str, list[int]] = field(default_factory=dict)  # pattern -> layers
    selected_paths: list[str] = field(default_factory=list)  # qualified module paths
    exclude_op: list[str] = field(default_factory=list)
    comm_paths: list[str] = field(default_factory=list)
    comm_note: str = ""
    layer_swap: list[int] = field(default_factory=list)
    op_swap: dict[str, list[int]] = field(default_factory=dict)
    swapped_paths: list[str] = field(default_factory=list)
    prefetch: int = 0
    swapper: ActivationSwap | None = None
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)  # every wrapped module

    def never_ran(self) -> list[str]:
        """Wrapped modules whose forward has not run in training (a model that calls their parts
        directly, never the module itself): recompute / swap has no effect on them."""
        return [name for name, m in self.modules if not m.activation_ran]

    def summary(self) -> str:
        parts: list[str] = []
        if self.full_layers:
            parts.append(f"recompute full: layers {_ranges(self.full_layers)}")
        for pattern, layers in self.select.items():
            parts.append(f"recompute select {pattern!r}: layers {_ranges(layers)}")
        if self.exclude_op:
            parts.append(f"recompute keeps outputs of ops containing {self.exclude_op}")
        if self.comm_note:
            parts.append(self.comm_note)
        if self.layer_swap:
            parts.append(f"swap layers {_ranges(self.layer_swap)} to CPU (prefetch {self.prefetch})")
        for pattern, layers in self.op_swap.items():
            parts.append(f"swap {pattern!r} of layers {_ranges(layers)} to CPU (prefetch {self.prefetch})")
        return "; ".join(parts) if parts else "activation memory: no recompute, no swap"


def _ranges(ids: Sequence[int]) -> str:
    ids = sorted(set(ids))
    out: list[str] = []
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def apply_activation_memory(
    model: nn.Module,
    recompute_section: Any = None,
    recompute_comm_section: Any = None,
    swap_section: Any = None,
    num_layers: int | None = None,
    *,
    pipeline_parallel: int = 1,
    has_comm_ops: bool = False,
) -> ActivationPlan:
    """Apply recompute, comm recompute and swap to ``model`` in place; return the plan (``summary()`` is
    its one-line description, ``never_ran()`` the parts whose forward has not run; the builder hands it to
    the trainer's ``ActivationPlanCallback``).

    ``num_layers``: decoder layers of the whole model (MTP layers come after them); layer specs are
    checked against it plus the MTP layers found. ``has_comm_ops``: whether the model's forward runs
    collectives (tensor / sequence / context / expert parallel); without them ``recompute_comm`` has
    nothing to do and says so.
    """
    plan = plan_activation_memory(
        model,
        recompute_section,
        recompute_comm_section,
        swap_section,
        num_layers,
        pipeline_parallel=pipeline_parallel,
        has_comm_ops=has_comm_ops,
    )
    return plan


def plan_activation_memory(
    model: nn.Module,
    recompute_section: Any = None,
    recompute_comm_section: Any = None,
    swap_section: Any = None,
    num_layers: int | None = None,
    *,
    pipeline_parallel: int = 1,
    has_comm_ops: bool = False,
) -> ActivationPlan:
    """Like :func:`apply_activation_memory`, returning the :class:`ActivationPlan`."""
    recompute = as_section("recompute", recompute_section).to_dict()
    recompute_comm = as_section("recompute_comm", recompute_comm_section).to_dict()
    swap = as_section("swap", swap_section).to_dict()
    mode = recompute.get("mode", "None")
    if mode is None:
        mode = "None"
    if mode not in ("None", "full", "select"):
        raise ConfigError(
            f"RecomputeConfig.mode must be 'None', 'full', or 'select', got {mode} (recompute.mode)"
        )
    comm_enabled = bool(recompute_comm.get("enable", False))
    swap_enabled = bool(swap.get("enable", False))
    plan = ActivationPlan()
    if mode == "None" and not comm_enabled and not swap_enabled:
        if recompute.get("exclude_op"):
            warnings.warn(
                "recompute.exclude_op has no effect while recompute.mode is 'None'", UserWarning, stacklevel=3
            )
        return plan

    layers = find_decoder_layers(model, num_layers)
    if not layers:
        raise ConfigError(
            "recompute / recompute_comm / swap name decoder layers, but the model has no decoder layer "
            "container (a ModuleList or ModuleDict named 'layers', e.g. decoder.layers.N)"
        )
    by_id = {d.layer_id: d for d in layers}
    mtp_count = sum(1 for d in layers if num_layers is not None and d.layer_id >= num_layers)
    # A pipeline stage may hold no MTP layer; the model's config still knows how many there are.
    configured_mtp = getattr(getattr(model, "config", None), "mtp_num_layers", None)
    if isinstance(configured_mtp, int) and num_layers is not None:
        mtp_count = max(mtp_count, configured_mtp)
    total = (num_layers if num_layers is not None else len(layers) - mtp_count) + mtp_count

    def present(ids: list[int]) -> list[DecoderLayer]:
        # Under pipeline parallelism a stage holds only some layers; the others are not ours.
        return [by_id[i] for i in ids if i in by_id]

    exclude_op = list(recompute.get("exclude_op") or [])
    policy = _exclude_op_policy(exclude_op) if exclude_op else None
    plan.exclude_op = [str(e) for e in exclude_op]

    # ---- recompute: full ------------------------------------------------------------------------
    full_ids: set[int] = set()
    if mode in ("full", "select") and recompute.get("full_recompute_layer") is not None:
        full_ids = set(_layers_of(recompute["full_recompute_layer"], "recompute.full_recompute_layer", total))
    elif mode == "full":
        raise ConfigError(
            "recompute.full_recompute_layer is required when recompute.mode is 'full': a list of layer specs "
            "such as ['0-3'] or ['0', '5']"
        )
    for d in present(sorted(full_ids)):
        recompute_module(d.module, policy)
    plan.full_layers = sorted(full_ids)

    # ---- recompute: select ----------------------------------------------------------------------
    if mode == "select":
        pairs = _module_specs(recompute.get("select_module"), "recompute.select_module")
        if not pairs and not full_ids:
            raise ConfigError(
                "recompute.select_module is required when recompute.mode is 'select': a mapping "
                "{module pattern: [layer specs]}, e.g. {'self_attention': ['0-1'], 'mlp': ['2']}"
            )
        taken: dict[int, set[str]] = {}
        for pattern, specs in pairs:
            label = f"recompute.select_module[{pattern!r}]"
            regex = _compile_pattern(pattern, label)
            ids = list(range(total)) if specs is None else _layers_of(specs, label, total)
            targets = [d for d in present(ids) if d.layer_id not in full_ids]
            matched_any = False
            for d in targets:
                for rel, module in _match_modules(d, regex, taken.setdefault(d.layer_id, set())):
                    recompute_module(module, policy)
                    taken[d.layer_id].add(rel)
                    plan.selected_paths.append(f"{d.name}.{rel}")
                    matched_any = True
            if targets and not matched_any and not _already_covered(targets, regex, taken):
                raise _no_match_error(label, pattern, targets)
            plan.select[pattern] = [d.layer_id for d in targets]

    # ---- recompute_comm -------------------------------------------------------------------------
    if comm_enabled:
        pairs = _module_specs(recompute_comm.get("select_module"), "recompute_comm.select_module")
        if not pairs:
            raise ConfigError(
                "recompute_comm.select_module is required when recompute_comm.enable is true: a mapping "
                "{module pattern: [layer specs]}, e.g. {'self_attention': ['0-3']}"
            )
        resolved: list[tuple[DecoderLayer, str, nn.Module]] = []
        for pattern, specs in pairs:
            label = f"recompute_comm.select_module[{pattern!r}]"
            regex = _compile_pattern(pattern, label)
            ids = list(range(total)) if specs is None else _layers_of(specs, label, total)
            targets = present(ids)
            found = [(d, rel, m) for d in targets for rel, m in _match_modules(d, regex)]
            if targets and not found:
                error = _no_match_error(label, pattern, targets)
                if has_comm_ops:
                    raise error
                # Nothing would be applied anyway (e.g. the spec's own example 'attention.qkv' on one
                # device): say it, but do not refuse a setting that is a no-op here.
                warnings.warn(str(error), UserWarning, stacklevel=3)
            resolved.extend(found)
        if not has_comm_ops:
            plan.comm_note = "recompute_comm: no effect (no communication ops in the forward on this layout)"
            warnings.warn(
                "recompute_comm.enable is true, but this run has no communication ops inside the model's "
                "forward (no tensor, sequence, context or expert parallelism), so it has no effect",
                UserWarning,
                stacklevel=3,
            )
        else:
            applied = []
            for d, rel, module in resolved:
                if d.layer_id in full_ids or is_recomputed(module):
                    continue  # already recomputed as a whole, collectives included
                recompute_module(module, _comm_recompute_policy)
                applied.append(f"{d.name}.{rel}")
            plan.comm_paths = applied
            plan.comm_note = f"recompute_comm: collectives re-run in backward in {len(applied)} module(s)"

    # ---- swap -----------------------------------------------------------------------------------
    if swap_enabled:
        if pipeline_parallel > 1:
            raise ConfigError(
                "swap is not supported with pipeline parallel (swap.enable with pipeline_parallel > 1)"
            )
        prefetch = swap.get("default_prefetch", 1)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 1 <= prefetch <= total - 1:
            raise ConfigError(
                f"swap.default_prefetch must be an int in [1, {total - 1}] (1 to the number of layers minus "
                f"one; the model has {total} layers), got {prefetch!r}"
            )
        swapper = ActivationSwap(prefetch)
        layer_swap = swap.get("layer_swap")
        op_swap = swap.get("op_swap")
        if not layer_swap and not op_swap:
            warnings.warn(
                "swap.enable is true but neither swap.layer_swap nor swap.op_swap names anything to swap",
                UserWarning,
                stacklevel=3,
            )
        max_layer = -1
        if layer_swap:
            entries = layer_swap if isinstance(layer_swap, list) else [layer_swap]
            first = entries[0]
            if not isinstance(first, Mapping) or "layers" not in first:
                raise ConfigError(
                    f"swap.layer_swap[0] must be a mapping {{layers: [layer specs]}}, got {first!r}"
                )
            if len(entries) > 1:
                warnings.warn(
                    "swap.layer_swap: only the first entry is used (as in the original); "
                    f"{len(entries) - 1} more ignored",
                    UserWarning,
                    stacklevel=3,
                )
            ids = _layers_of(first["layers"], "swap.layer_swap[0].layers", total)
            max_layer = max(ids, default=-1)
            for d in present(ids):
                swap_module(d.module, swapper, d.layer_id)
            plan.layer_swap = ids
        if op_swap:
            entries = op_swap if isinstance(op_swap, list) else [op_swap]
            swapped_layers = set(plan.layer_swap)
            for i, entry in enumerate(entries):
                label = f"swap.op_swap[{i}]"
                if not isinstance(entry, Mapping) or "op_name" not in entry or "layers" not in entry:
                    raise ConfigError(
                        f"{label} must be a mapping {{op_name: <pattern>, layers: [specs]}}, got {entry!r}"
                    )
                pattern = entry["op_name"]
                regex = _compile_pattern(pattern, f"{label}.op_name")
                ids = _layers_of(entry["layers"], f"{label}.layers", total)
                max_layer = max([max_layer, *ids])
                targets = [d for d in present(ids) if d.layer_id not in swapped_layers]
                found = [(d, rel, m) for d in targets for rel, m in _match_modules(d, regex)]
                if targets and not found:
                    raise _no_match_error(f"{label}.op_name", pattern, targets)
                for d, rel, module in found:
                    swap_module(module, swapper, d.layer_id)
                    plan.swapped_paths.append(f"{d.name}.{rel}")
                plan.op_swap[str(pattern)] = ids
        if max_layer >= 0 and max_layer + prefetch >= total:
            raise ConfigError(
                f"swap: the highest swapped layer ({max_layer}) plus swap.default_prefetch ({prefetch}) must be "
                f"less than the number of layers ({total}); lower default_prefetch or swap earlier layers"
            )
        overlap = sorted(full_ids & (set(plan.layer_swap) | {i for v in plan.op_swap.values() for i in v}))
        if overlap:
            warnings.warn(
                f"swap on layers {_ranges(overlap)} has no effect: they are fully recomputed, so they keep no "
                "activations to swap",
                UserWarning,
                stacklevel=3,
            )
        plan.prefetch = prefetch
        plan.swapper = swapper

    plan.modules = [(name, m) for name, m in model.named_modules() if isinstance(m, ActivationWrapper)]
    return plan


def _already_covered(targets: list[DecoderLayer], regex: NamePattern, taken: dict[int, set[str]]) -> bool:
    """A pattern whose matches all sit inside modules another pattern already recomputes is fine."""
    for d in targets:
        for rel_path, _ in d.module.named_modules():
            if rel_path and any(regex.fullmatch(f) for f in _path_forms(d, rel_path)):
                return True
    return False
