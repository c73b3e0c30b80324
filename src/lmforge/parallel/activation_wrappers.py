"""Recompute as a visible part of the module: the ``Recomputed<Class>`` wrapper and its policies.

Recompute makes a module a :class:`Recomputed` one, whose forward runs the original under
non-reentrant ``torch.utils.checkpoint``. Like torch's ``fully_shard``, the wrapper is a subclass of
the module's own class (``RecomputedTransformerLayer``), so it shows in ``print(model)`` while the
module stays in place: parameter names, state_dict keys, optimizer name patterns and FSDP are
unaffected (no ``_checkpoint_wrapped_module`` segment, no method assigned to the instance).
``exclude_op`` turns this into selective activation checkpointing: ops whose name contains an entry
are saved (``MUST_SAVE``), everything else is recomputed. Communication recompute checkpoints with a
policy that saves every op except the collectives (``_c10d_functional`` / ``c10d`` ops), which are
re-run in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

# Collective ops as they appear under the dispatcher (functional collectives used by DTensor, and the
# c10d ops used by explicit process-group calls).
_COMM_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")


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


def recompute_module(module: nn.Module, policy: Callable[..., CheckpointPolicy] | None = None) -> None:
    """Make ``module`` recompute its forward in backward instead of keeping its activations.

    With ``policy`` the checkpoint is selective: ops the policy marks ``MUST_SAVE`` keep their outputs.
    A module that is already recomputed keeps its first policy.
    """
    if not wrap_module(module, Recomputed):
        return
    if policy is not None:
        module.recompute_context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
