"""Measure a single-process training step's peak memory and put it beside ``lmforge check``'s estimate.

The measurement counts, at every operator of two full training steps (forward, backward, clipping,
optimizer step), the bytes of all tensor storages alive (each storage once, at its current size, freed
when its last reference goes; the same accounting as ``torch.distributed._tools.mem_tracker``, which
refuses a module called twice per step), plus the model's parameters and buffers that exist before. It
is independent of lmforge's estimator.

The 16-bit matrix products (matmuls and CPU flash attention, forward and backward) are not computed:
their outputs are zero tensors of the shape, strides and dtype the operator gives (its meta kernel),
allocated as the operator would allocate them. Memory is the same (same storages, same lifetimes; a
test compares the two ways); the values do not matter to it, and zeros keep the step finite (zero
gradients, an optimizer step that moves nothing but still allocates its states). So the bf16 cases cost
no time on a CPU that emulates bf16 (~100x slower than float32 there).

A storage's size is re-read at every operator: FSDP2 frees a layer's unsharded parameters by resizing
their storages to 0 bytes (``untyped_storage().resize_(0)``, no operator the dispatch mode sees) and
re-grows them at the next all-gather; counting each storage at its size when created kept every layer's
unsharded copy alive for the whole step (3-5 MiB too high on the 2-rank FSDP cases).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lmforge.config import load_config
from lmforge.lr import ScheduleLR, build_scheduler
from lmforge.models import build_model, build_model_config
from lmforge.optim import build_optimizer
from lmforge.parallel import ParallelDims
from lmforge.tools.memory import estimate_memory, selected_recompute_parts
from lmforge.train.builder import build_training_model
from lmforge.train.step import TrainStep

BASE: dict[str, Any] = {
    "training": {"steps": 4, "local_batch_size": 2, "global_batch_size": 2, "max_norm": 1.0},
    "optimizer": {"type": "AdamW", "weight_decay": 0.01},
    "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1.0e-3, "warmup_steps": 0},
    # batches are made by hand; a text loader is checked at load without reading its files
    "train_dataset": {
        "dataloader": {"type": "TextDataLoader", "data_path": ["unused.jsonl"], "tokenizer": "unused"}
    },
    "model": {
        "model_type": "qwen3",
        "architectures": "Qwen3ForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "vocab_size": 2048,
        "seq_length": 256,
        "compute_dtype": "float32",
    },
}


def config(**changes: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    for key, value in changes.items():
        node = raw
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return raw


def estimate(raw: dict[str, Any]) -> Any:
    cfg = load_config(raw)
    mc = build_model_config(cfg.model)
    net = build_model(cfg.model, device="meta")
    dims = ParallelDims.from_section(cfg.parallelism, 1)
    lbs = int(cfg.training.local_batch_size)
    return estimate_memory(
        net,
        dims,
        compute_dtype=getattr(net, "compute_dtype", torch.float32),
        optimizer_type=str(cfg.optimizer.type if hasattr(cfg.optimizer, "type") else "AdamW"),
        seq_length=mc.seq_length,
        local_batch_size=lbs,
        hidden_size=mc.hidden_size,
        num_layers=mc.num_layers,
        vocab_size=mc.vocab_size,
        accumulation_steps=max(1, int(cfg.training.global_batch_size) // lbs),
        offload_states=bool(getattr(cfg.optimizer, "offload_states", False)),
        recompute_select=selected_recompute_parts(net, cfg.recompute, mc.num_layers),
    )


_aten = torch.ops.aten
# Matrix products whose 16-bit outputs are allocated, not computed (see the module docstring).
UNCOMPUTED_16BIT = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
_16BIT = (torch.bfloat16, torch.float16)


def _zero_outputs(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """The outputs of ``func`` as zero tensors: shapes and strides from its meta kernel, storages
    allocated here like the kernel's own."""

    def to_meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    meta_out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))

    def real(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()

    return tree_map(real, meta_out)


class LiveStorageBytes(TorchDispatchMode):
    """Peak of the summed ``nbytes`` of live storages created by operators (plus ``track``-ed tensors)."""

    def __init__(self, compute_16bit_matmuls: bool = False) -> None:
        super().__init__()
        self.compute_16bit_matmuls = compute_16bit_matmuls
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.paused = False  # while True, new storages are host memory (the offloaded optimizer step)
        self._refs: dict[int, weakref.ref] = {}

    def track(self, t: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):  # a sharded parameter or activation: what this rank holds
            t = t._local_tensor
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)

        def gone(_ref: Any, key: int = key) -> None:
            self.current -= self.live.pop(key, 0)
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, gone)

    def _resync_sizes(self) -> None:
        """Re-read every live storage's size: FSDP2 frees and re-grows unsharded parameters with
        ``resize_``, which runs no operator (see the module docstring)."""
        for key, ref in list(self._refs.items()):
            st = ref()
            if st is None or key not in self.live:
                continue
            n = st.nbytes()
            if n != self.live[key]:
                self.current += n - self.live[key]
                self.live[key] = n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        skip = not self.compute_16bit_matmuls and func in UNCOMPUTED_16BIT
        if skip and any(isinstance(t, torch.Tensor) and t.dtype in _16BIT for t in tree_flatten(args)[0]):
            out = _zero_outputs(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.paused:
            return out
        # Sizes changed since the last operator (a resize runs none) are read before the outputs are
        # added, so the total at the end of this operator is right (FSDP2's all-gather copy-out writes
        # into storages it has just re-grown).
        self._resync_sizes()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.track(t)
        self.peak = max(self.peak, self.current)
        return out


def measure(raw: dict[str, Any], steps: int = 1, compute_16bit_matmuls: bool = False) -> int:
    cfg = load_config(raw)
    torch.manual_seed(0)
    mc = build_model_config(cfg.model)
    hook = None
    if raw.get("recompute"):
        from lmforge.parallel.activation import apply_activation_memory

        def hook(model):
            apply_activation_memory(model, cfg.recompute, cfg.recompute_comm, cfg.swap, mc.num_layers)

    # As the trainer builds it: FSDP2 over this one process (fp32 parameters, compute-dtype gathers).
    model, ctx = build_training_model(cfg.model, seed=0, device="cpu", before_fsdp=hook)
    schedule = build_scheduler(cfg.lr_scheduler, int(cfg.training.steps))
    optimizer = build_optimizer(cfg.optimizer, model, schedule)
    tracker = LiveStorageBytes(compute_16bit_matmuls)
    offload = bool(getattr(cfg.optimizer, "offload_states", False))
    if offload:
        # optimizer.offload_states: the states and the update live in host memory.
        # On a CPU-only machine the device's share is what remains: storages the optimizer holds or
        # allocates during its step are left out (they would be host memory on a GPU).
        host_step = optimizer.step

        def step_on_host(*args: Any, **kwargs: Any) -> Any:
            tracker.paused = True
            try:
                return host_step(*args, **kwargs)
            finally:
                tracker.paused = False

        optimizer.step = step_on_host
    step = TrainStep(model, optimizer, ScheduleLR(optimizer, schedule), max_norm=1.0, ctx=ctx)
    lbs = int(cfg.training.local_batch_size)
    accum = max(1, int(cfg.training.global_batch_size) // lbs)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(accum):
        ids = torch.randint(1, mc.vocab_size, (lbs, mc.seq_length), generator=g)
        batches.append({"input_ids": ids, "labels": torch.roll(ids, -1, 1)})
    for t in [*model.parameters(), *model.buffers()]:
        tracker.track(t)
    for b in batches:
        for t in b.values():
            tracker.track(t)
    # Optimizer states that exist before the first step (lmforge's optimizers allocate them eagerly).
    held = [
        getattr(optimizer, "state", {}),
        [g.get("params", []) for g in getattr(optimizer, "param_groups", [])],
    ]
    for state in [] if offload else held:
        for t in tree_flatten(state)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                tracker.track(t)
    with tracker:
        for _ in range(steps):
            step(batches)
    return tracker.peak
