"""The training doctor, live: the rules of :mod:`lmforge.tools.doctor.rules` run during training.

At the start it writes ``config.yaml`` (the resolved configuration) and ``doctor_facts.json`` (what
only the live run can see: frozen parameters, parameters in no optimizer group, norms and biases
that get weight decay) into the run directory, so that ``lmforge doctor RUN_DIR`` can use them later.
It checks at steps 5, 10 and 20, then every ``monitor.doctor.check_interval`` steps and at the end,
and logs each finding once as a warning (with the keys to change); on check steps the step's metrics
get ``doctor_findings`` (findings so far), which the experiment trackers log. Cost: the rules read a bounded
window of the step metrics (first 50 and last 1000 steps); the parameter check compares 256 sampled
elements per parameter with their values at the start. MoE models also get
``moe_max_expert_share`` in the step's metrics (the largest share of a layer's routed tokens one
expert received in the step).
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import Any

import torch

from lmforge.config.schema import TrainConfig
from lmforge.tools.doctor.evidence import CONFIG_FILE, FACTS_FILE, RunEvidence
from lmforge.tools.doctor.rules import Finding, diagnose
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.doctor")

_HEAD, _TAIL = 50, 1000
_SAMPLE = 256
_EARLY_CHECKS = (5, 10, 20)
_KEPT = (
    "loss_scale",
    "step",
    "loss",
    "lr",
    "grad_norm",
    "skipped",
    "skip_reason",
    "max_attention_logit",
    "moe_max_expert_share",
    "moe_max_expert_share_layer",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP / TP): this rank's shard
    return to_local() if callable(to_local) else t


def _sample(p: torch.Tensor) -> torch.Tensor:
    flat = _local(p.detach()).reshape(-1)
    if flat.numel() <= _SAMPLE:
        return flat.float().cpu().clone()
    idx = torch.linspace(0, flat.numel() - 1, _SAMPLE, device=flat.device).long()
    return flat[idx].float().cpu()


def _config_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config) if isinstance(config, dict) else {}


class DoctorCallback(TrainerCallback):
    order = 35  # after memory / max-logit metrics, before TensorBoard (40) and metrics.jsonl (90)

    def __init__(self, check_interval: int = 50, output_dir: str | Path | None = None) -> None:
        self.check_interval = int(check_interval)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.config: dict[str, Any] = {}
        self.facts: dict[str, Any] = {}
        self.head: list[dict[str, Any]] = []
        self.tail: deque[dict[str, Any]] = deque(maxlen=_TAIL)
        self.reported: set[tuple[str, str]] = set()
        self.findings: list[Finding] = []  # every finding reported so far (for tests and tools)
        self.rollbacks: list[dict[str, Any]] = []  # recovery's rollback events of this run
        self._start: dict[str, torch.Tensor] = {}
        self._params: dict[str, torch.Tensor] = {}
        self._moe_previous: dict[int, torch.Tensor] = {}
        self._rank = 0

    # -- start -----------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs.get("trainer")
        self._rank = int(getattr(getattr(trainer, "ctx", None), "rank", 0) or 0)
        if self.output_dir is None and trainer is not None:
            self.output_dir = Path(trainer.output_dir)
        self.config = _config_dict(args)
        model = kwargs.get("model")
        model = model[0] if isinstance(model, (list, tuple)) else model
        optimizer = kwargs.get("optimizer")
        if model is not None:
            self.facts = self._parameter_facts(model, optimizer)
            per_epoch = _samples_per_epoch(trainer)
            if per_epoch:
                self.facts["train_samples_per_epoch"] = per_epoch  # for the repeated-data rule
            self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
            self._start = {n: _sample(p) for n, p in self._params.items()}
        training = getattr(args, "training", None)
        if getattr(training, "epochs", None) is not None:
            self.facts["training_steps"] = int(
                training.steps
            )  # derived from the data; config.yaml keeps epochs
        self._write_files()

    def _parameter_facts(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        names = {id(p): n for n, p in model.named_parameters()}
        in_groups: dict[int, int] = {}
        decayed_1d = []
        for group in getattr(optimizer, "param_groups", None) or []:
            for p in group.get("params", []):
                in_groups[id(p)] = in_groups.get(id(p), 0) + 1
                if float(group.get("weight_decay", 0.0) or 0.0) > 0 and p.ndim == 1 and id(p) in names:
                    decayed_1d.append(names[id(p)])
        params = list(model.named_parameters())
        facts: dict[str, Any] = {
            "parameters": sum(_local(p).numel() for _, p in params),
            "frozen": [n for n, p in params if not p.requires_grad],
            # An optimizer that holds other tensors (fp32 masters) cannot be matched by identity.
            "not_in_optimizer": [n for n, p in params if p.requires_grad and id(p) not in in_groups]
            if in_groups and any(id(p) in in_groups for _, p in params)
            else [],
            "decayed_1d": decayed_1d,
            "duplicated_in_optimizer": [names[i] for i, c in in_groups.items() if c > 1 and i in names],
            "compute_dtype": str(
                getattr(model, "compute_dtype", next((p.dtype for _, p in params), ""))
            ).replace("torch.", ""),
            "optimizer_type": type(optimizer).__name__ if optimizer is not None else None,
            "world_size": int(torch.distributed.get_world_size())
            if torch.distributed.is_initialized()
            else 1,
        }
        device = next((p.device for _, p in params), None)
        if device is not None and device.type == "cuda":
            facts["device_memory_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
        compute = getattr(model, "compute_dtype", None)
        if device is not None and isinstance(compute, torch.dtype):
            from lmforge.utils.native_dtype import emulation_warning

            # Measured on the run's own device: the offline doctor may read the run on another machine.
            note = emulation_warning(compute, device.type)
            if note is not None:
                facts["compute_dtype_emulated"] = note
        experts = getattr(model, "tokens_per_expert", None)
        if callable(experts):
            counts = experts()
            if counts:
                facts["moe_num_experts"] = int(next(iter(counts.values())).numel())
                cfg = getattr(model, "config", None)
                top_k = getattr(cfg, "moe_router_topk", None) or getattr(cfg, "num_experts_per_tok", None)
                if top_k:
                    facts["moe_top_k"] = int(top_k)
        return facts

    def _write_files(self) -> None:
        if self._rank != 0 or self.output_dir is None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.config:
            from lmforge.config.yaml_io import dump_yaml_text

            (self.output_dir / CONFIG_FILE).write_text(dump_yaml_text(self.config), encoding="utf-8")
        (self.output_dir / FACTS_FILE).write_text(json.dumps(self.facts, indent=1) + "\n")

    # -- every step ------------------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics")
        if not isinstance(metrics, dict):
            return
        model = kwargs.get("model")
        model = model[0] if isinstance(model, (list, tuple)) else model
        self._expert_share(model, metrics)
        record = {k: metrics[k] for k in _KEPT if k in metrics}
        (self.head if len(self.head) < _HEAD else self.tail).append(record)
        step = int(state.global_step)
        if step in _EARLY_CHECKS or step % self.check_interval == 0:
            self.check(step)
            # On check steps: the number of findings so far, for the trackers (W&B, MLflow) that log
            # every numeric field of the step's metrics.
            metrics["doctor_findings"] = len(self.findings)

    def on_rollback(self, args: Any, state: Any, **kwargs: Any) -> None:
        # Recovery undid the steps after to_step (train/recovery/): the rules judge the run as it goes on.
        event = kwargs["rollback"]
        to_step = int(event["to_step"])
        self.rollbacks.append(dict(event))
        self.head = [r for r in self.head if int(r.get("step", 0)) <= to_step]
        self.tail = deque((r for r in self.tail if int(r.get("step", 0)) <= to_step), maxlen=_TAIL)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.check(int(state.global_step))

    def _expert_share(self, model: Any, metrics: dict[str, Any]) -> None:
        read = getattr(model, "tokens_per_expert", None)
        if not callable(read) or "moe_num_experts" not in self.facts:
            return
        best = (-1.0, -1)
        for layer, now in read().items():
            now = now.detach().float().cpu()
            before = self._moe_previous.get(layer)
            # Counters reset by moe_monitor (after each micro-batch) read as fresh counts.
            delta = now if before is None or bool((now < before).any()) else now - before
            self._moe_previous[layer] = now
            total = float(delta.sum())
            if total > 0:
                best = max(best, (float(delta.max()) / total, int(layer)))
        if best[1] >= 0:
            metrics["moe_max_expert_share"] = best[0]
            metrics["moe_max_expert_share_layer"] = best[1]

    # -- checking --------------------------------------------------------------------------------

    def _update_not_updated(self, step: int) -> None:
        if not self._start or not any((r.get("lr") or 0) > 0 for r in [*self.head, *self.tail]):
            return
        stuck = [n for n, p in self._params.items() if torch.equal(_sample(p), self._start[n])]
        self.facts["not_updated"] = stuck
        self.facts["not_updated_checked_at_step"] = step

    def evidence(self) -> RunEvidence:
        return RunEvidence(
            metrics=[*self.head, *self.tail],
            config=self.config,
            facts=self.facts,
            rollbacks=list(self.rollbacks),
        )

    def check(self, step: int) -> list[Finding]:
        if not self.head:
            return []  # no step of this process yet (e.g. resumed at the last step): nothing to judge live
        self._update_not_updated(step)
        diagnosis = diagnose(self.evidence())
        new = []
        for f in diagnosis.findings:
            key = (f.symptom, f.cause)
            if key in self.reported:
                continue
            self.reported.add(key)
            self.findings.append(f)
            new.append(f)
            if self._rank == 0:
                keys = (
                    ", ".join(f"{k}: {_show(v)}" for k, v in f.keys.items()) or "(no YAML key: see the cause)"
                )
                logger.warning(
                    "doctor at step %d: %s. Evidence: %s. Likely cause: %s. Change: %s",
                    step,
                    f.symptom,
                    f.evidence,
                    f.cause,
                    keys,
                )
        if self._rank == 0 and self.output_dir is not None and self.output_dir.is_dir():
            (self.output_dir / FACTS_FILE).write_text(json.dumps(self.facts, indent=1) + "\n")
        return new


def _samples_per_epoch(trainer: Any) -> int | None:
    """Samples in one pass over the training set (the loader's micro-batches per epoch x micro-batch samples)."""
    loader = getattr(trainer, "dataloader", None)
    batches = getattr(trainer, "batches", None)
    try:
        micro = len(loader)
    except TypeError:
        return None
    return int(micro) * int(batches.samples_per_micro_step) if micro and batches is not None else None


def _show(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    return json.dumps(value)


def doctor_callback(config: TrainConfig, output_dir: str | Path) -> DoctorCallback | None:
    """The live doctor of a run, or None when ``monitor.doctor.enable`` is false."""
    monitor = config.monitor
    if not monitor.doctor.enable:
        return None
    return DoctorCallback(int(monitor.doctor.check_interval), output_dir)
