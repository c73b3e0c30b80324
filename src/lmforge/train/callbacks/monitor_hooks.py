"""Training monitors: per-parameter gradient norms and losses, MoE tokens per expert, peak memory.

They attach to the model through hooks, so the train step knows nothing about them:

* ``monitor.train_state`` — ``local_norm`` (each micro-batch's gradient of each selected parameter,
  as produced by that backward, before accumulation), ``device_norm`` (the accumulated gradient of
  the step, after the last micro-batch and before clipping), ``local_loss`` (each micro-batch's
  loss, read from the model output) and ``device_loss`` (the step's loss as the trainer reports
  it). Selectors: ``True`` = every parameter, a non-empty string = parameters whose name contains
  it, a list = any of several substrings; ``""``, ``False`` and ``[]`` = off.
* ``monitor.moe_monitor`` — tokens routed to each expert of the target layers, per micro-batch,
  every ``save_tokens_per_expert_interval`` micro-batches (the original's monitor never received
  these records; this one does).
* peak memory of each step: the CUDA caching allocator's peak on a GPU, the process's peak resident
  set size on a CPU (Linux resets it per step through ``/proc/self/clear_refs``).

Every record is one JSON object per line.
"""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from lmforge.errors import ConfigError
from lmforge.utils.logging import get_logger

log = get_logger("lmforge.train.callbacks.monitor_hooks")


def norm_filters(value: Any, name: str) -> list[str] | None:
    """``None`` when off, ``[]`` for every parameter, else the substrings a name must contain one of."""
    if isinstance(value, bool):
        return [] if value else None
    if isinstance(value, str):
        return [value] if value else None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        kept = [v for v in value if v]
        return kept if kept else None
    raise ConfigError(f"{name} only supports bool, str, or list[str]; got {value!r}")


def _selected(name: str, filters: list[str] | None) -> bool:
    return filters is not None and (not filters or any(f in name for f in filters))


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor gradient (FSDP / TP) is measured on this rank's shard: a *local* norm.
    return t.to_local() if hasattr(t, "to_local") else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(_local(t).detach().float()))


class JsonLines:
    """An append-only JSON-lines file, opened on first write."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    if isinstance(output, dict):
        return output.get("loss")
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0] if output[0].numel() == 1 else None
    return getattr(output, "loss", None)


class TrainStateMonitor:
    """``monitor.train_state``: local / device gradient norms and losses as JSON lines."""

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        local_norm: Any = "",
        device_norm: Any = False,
        local_loss: bool = False,
        device_loss: bool = False,
    ) -> None:
        self.model = model
        self.local_filters = norm_filters(local_norm, "monitor.train_state.local_norm")
        self.device_filters = norm_filters(device_norm, "monitor.train_state.device_norm")
        self.local_loss = bool(local_loss)
        self.device_loss = bool(device_loss)
        self.out = JsonLines(path)
        self.step = 0
        self.micro_step = 0  # 1-based index of the micro-batch whose backward runs now
        self._local: dict[int, dict[str, float]] = {}
        self._accumulated: dict[str, torch.Tensor] = {}  # sharded parameters' gradient so far this step
        self._device: dict[str, float] = {}
        self._handles: list[Any] = []

    @property
    def enabled(self) -> bool:
        return (
            self.local_filters is not None
            or self.device_filters is not None
            or self.local_loss
            or self.device_loss
        )

    def attach(self) -> None:
        if not self.enabled or self._handles:
            return
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            if _selected(name, self.local_filters):
                if _is_dtensor(param):
                    # FSDP2 feeds the gradient to a separate unsharded parameter, so a tensor hook
                    # on the sharded one never fires; its post-accumulate hook does (after the
                    # reduce-scatter): the micro-batch's share is the growth of the accumulated shard.
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(self._local_sharded_hook(name))
                    )
                else:
                    self._handles.append(param.register_hook(self._local_hook(name)))
            if _selected(name, self.device_filters):
                self._handles.append(param.register_post_accumulate_grad_hook(self._device_hook(name)))
        # Each training forward is one micro-batch: count them and read their loss.
        self._handles.append(self.model.register_forward_hook(self._after_forward))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _local_hook(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            self._local.setdefault(max(self.micro_step, 1), {})[name] = _norm(grad)

        return hook

    def _local_sharded_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            now = _local(grad).detach().float()
            before = self._accumulated.get(name)
            share = now if before is None else now - before
            self._accumulated[name] = now.clone()
            self._local.setdefault(max(self.micro_step, 1), {})[name] = float(torch.linalg.vector_norm(share))

        return hook

    def _device_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            # Fires after every accumulation; the last value of the step is the full gradient.
            if param.grad is not None:
                self._device[name] = float(torch.linalg.vector_norm(_local(param.grad).detach().float()))

        return hook

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation forwards are not micro-batches
        self.micro_step += 1
        if self.local_loss:
            loss = _loss_of(output)
            if loss is not None:
                value = float(_local(loss).detach().float())
                self.out.write({"step": self.step, "micro_step": self.micro_step, "local_loss": value})

    def begin_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run."""
        self.step = step
        self.micro_step = 0
        self._local.clear()
        self._device.clear()
        self._accumulated.clear()

    def end_step(self, loss: float | None = None) -> None:
        for micro, norms in sorted(self._local.items()):
            self.out.write({"step": self.step, "micro_step": micro, "local_norm": norms})
        if self._device:
            self.out.write({"step": self.step, "device_norm": dict(self._device)})
        if self.device_loss and loss is not None:
            self.out.write({"step": self.step, "device_loss": float(loss)})

    def close(self) -> None:
        self.detach()
        self.out.close()


def _summed_over_routing_group(model: nn.Module, counts: dict[Any, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Layer id -> int64 counts summed over the ranks that route different tokens of the same layers (the
    expert-bias group, ``models.common.moe.routing_counts_group``): under tensor / sequence parallel each
    rank routes only its shard of the sequence, so its own counts depend on the layout. One all-reduce."""
    from lmforge.models.common.moe import routing_counts_group

    layers = sorted(counts)
    group = routing_counts_group(model)
    if group is not None and layers:
        import torch.distributed as dist

        flat = torch.cat([counts[i].detach().reshape(-1).float() for i in layers])
        dist.all_reduce(flat, group=group)
        summed = flat.split([counts[i].numel() for i in layers])
        counts = {i: c.view_as(counts[i]) for i, c in zip(layers, summed, strict=True)}
    return {int(i): counts[i].detach().to("cpu", torch.int64) for i in layers}


class MoeTokenMonitor:
    """``monitor.moe_monitor``: tokens per expert of the target layers, per micro-batch.

    Reads the model's ``tokens_per_expert()`` (layer id -> counts since the last reset) after every
    training forward and resets them with ``reset_tokens_per_expert()``; a model without a reset is
    read as a running total, recording the difference to the previous reading.
    """

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        interval: int | None,
        target_layers: int | Sequence[int] | None = None,
        num_layers: int | None = None,
    ) -> None:
        self.model = model
        self.interval = interval
        if isinstance(target_layers, int) and not isinstance(target_layers, bool):
            target_layers = list(range(target_layers))
        self.target_layers = None if target_layers is None else sorted(set(target_layers))
        self.num_layers = num_layers
        self.out = JsonLines(path)
        self.step = 0
        self.micro_step = 0
        self.micro_batches_seen = 0
        self._previous: dict[int, torch.Tensor] = {}
        self._handle: Any = None

    @property
    def enabled(self) -> bool:
        return self.interval is not None

    def attach(self) -> None:
        if not self.enabled or self._handle is not None:
            return
        if not callable(getattr(self.model, "tokens_per_expert", None)):
            raise ConfigError(
                "monitor.moe_monitor.save_tokens_per_expert_interval is set, but the model has no experts "
                "(it does not report tokens per expert); remove monitor.moe_monitor or use an MoE model"
            )
        available = sorted(self.model.tokens_per_expert())
        if self.target_layers is not None:
            missing = [i for i in self.target_layers if i not in available]
            if missing:
                # The spec's own skeleton targets [0, 1, 2] of a DeepSeek-V3 whose first layers are
                # dense: not an error, but nothing is recorded for those layers.
                log.warning(
                    "monitor.moe_monitor.target_layers: layers %s have no experts (dense layers) and are "
                    "skipped; MoE layers of this model: %s",
                    missing,
                    available,
                )
        self._handle = self.model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.micro_step += 1
        self.micro_batches_seen += 1
        counts = {int(k): v.detach().to("cpu", torch.int64) for k, v in module.tokens_per_expert().items()}
        reset = getattr(module, "reset_tokens_per_expert", None)
        if callable(reset):
            # The counters are the monitor's own: restart them so they hold one micro-batch (a
            # run-long float32 sum would stop counting exactly past 2**24 tokens per expert).
            reset()
            counts_are_fresh = True
        else:
            counts_are_fresh = False
        deltas: dict[int, torch.Tensor] = {}
        for layer, now in counts.items():
            before = self._previous.get(layer)
            if counts_are_fresh or before is None or before.shape != now.shape or bool((now < before).any()):
                deltas[layer] = now  # counters were reset since the last reading
            else:
                deltas[layer] = now - before
        self._previous = counts
        if self.micro_batches_seen % self.interval != 0:
            return
        # Every rank of the group records at the same micro-batch: one all-reduce per record, not per forward.
        deltas = _summed_over_routing_group(module, deltas)
        for layer in sorted(deltas):
            if self.target_layers is not None and layer not in self.target_layers:
                continue
            record: dict[str, Any] = {"step": self.step, "micro_step": self.micro_step, "layer": layer}
            if self.num_layers is not None and layer >= self.num_layers:
                record["mtp_idx"] = layer - self.num_layers
            record["tpe"] = deltas[layer].tolist()
            self.out.write(record)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.micro_step = 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.out.close()


class PeakMemory:
    """Peak memory of one step: CUDA allocator statistics on a GPU, peak RSS of the process on a CPU."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else _default_device()
        self._can_reset_rss = Path("/proc/self/clear_refs").exists()

    def begin_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._can_reset_rss:
            try:
                # "5" resets the peak RSS (VmHWM) of this process to its current RSS (Linux >= 4.0).
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._can_reset_rss = False

    def end_step(self) -> dict[str, float]:
        """Peak bytes since :meth:`begin_step` (``peak_rss_bytes`` is since start if it cannot reset)."""
        if self.device.type == "cuda":
            return {
                "peak_allocated_bytes": float(torch.cuda.max_memory_allocated(self.device)),
                "peak_reserved_bytes": float(torch.cuda.max_memory_reserved(self.device)),
            }
        return {"peak_rss_bytes": float(_peak_rss_bytes())}


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


def format_bytes(n: float) -> str:
    if not math.isfinite(n):
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n:.2f}GiB"
