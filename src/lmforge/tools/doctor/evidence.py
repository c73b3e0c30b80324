"""What the doctor looks at, read from a run directory (or filled in live by the doctor callback).

A run directory holds ``metrics.jsonl`` (one record per step), ``train.log``, ``config.yaml`` (the
resolved configuration, written at the start of training), ``doctor_facts.json`` (facts about the
parameters and the optimizer that only the live run can see: frozen or never-updated parameters,
decayed norms and biases) and, when configured, ``monitor/*.jsonl``. The checkpoints' metadata
(``common.json``) is found through the config's ``checkpoint.save_path``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.doctor")

FACTS_FILE = "doctor_facts.json"
CONFIG_FILE = "config.yaml"
_LOG_TAIL_LINES = 2000


@dataclass
class RunEvidence:
    metrics: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # resolved config as a plain mapping
    facts: dict[str, Any] = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)
    # layer -> list of per-record token counts per expert (monitor/tokens_per_expert_rank*.jsonl)
    tokens_per_expert: dict[int, list[list[int]]] = field(default_factory=dict)
    # rank -> local losses (monitor/train_state_rank*.jsonl, monitor.train_state.local_loss)
    rank_losses: dict[int, list[float]] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None  # the latest checkpoint's common.json
    # metrics.jsonl's {"event": "rollback", ...} lines (train/recovery/), in order
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict, repr=False)  # values the rules derive once

    def section(self, name: str) -> dict[str, Any]:
        value = self.config.get(name)
        return value if isinstance(value, dict) else {}

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of a numeric metric, skipped steps included (their values are what the step saw)."""
        out = []
        for r in self.metrics:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append((int(r.get("step", len(out) + 1)), float(v)))
        return out


# The fields DoctorCallback writes to doctor_facts.json and their types: a field of another type (a
# damaged or hand-edited file) is dropped and reported, so that no rule crashes on it.
_NAMES = (list, str)
_FACT_TYPES: dict[str, tuple[type, type | None]] = {
    **{
        k: _NAMES
        for k in ("frozen", "not_in_optimizer", "not_updated", "decayed_1d", "duplicated_in_optimizer")
    },
    **{k: (str, None) for k in ("compute_dtype", "optimizer_type")},
    **{
        k: (int, None)
        for k in (
            "parameters",
            "world_size",
            "device_memory_bytes",
            "moe_num_experts",
            "moe_top_k",
            "not_updated_checked_at_step",
            "training_steps",
        )
    },
}


def _fact_ok(value: Any, kind: tuple[type, type | None]) -> bool:
    outer, inner = kind
    if value is None or isinstance(value, bool) or not isinstance(value, outer):
        return value is None and outer is str  # optimizer_type may be null (no optimizer)
    return inner is None or all(isinstance(v, inner) for v in value)


def _read_facts(path: Path) -> dict[str, Any]:
    """doctor_facts.json with every field of the wrong type dropped (and reported), never a crash."""
    try:
        facts = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError:
        facts = None
    if not isinstance(facts, dict):
        logger.warning("%s is not the JSON object lmforge writes; its facts are ignored.", path)
        return {}
    bad = sorted(k for k, kind in _FACT_TYPES.items() if k in facts and not _fact_ok(facts[k], kind))
    if bad:
        logger.warning("%s: ignored field(s) of an unexpected type: %s.", path, ", ".join(bad))
    return {k: v for k, v in facts.items() if k not in bad}


# The fields every rule takes as a step number: a record whose value is not one (a hand-edited or damaged
# line: "step": "four", null, 1e400) is dropped and reported rather than crashing a rule's int().
_STEP_FIELDS = ("step", "to_step")


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON-object lines of ``path``. The last line may be cut by a crash and is skipped silently;
    any other line that is not a JSON object, or whose step fields are not whole numbers, is skipped and
    reported (path and line numbers), never a crash."""
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    unreadable: list[int] = []
    bad_steps: list[int] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(
                line, parse_constant=lambda c: {"NaN": math.nan, "Infinity": math.inf}.get(c, -math.inf)
            )
        except (json.JSONDecodeError, RecursionError):
            if number < len(lines):  # the last line is the one a crash cuts
                unreadable.append(number)
            continue
        if not isinstance(record, dict):
            unreadable.append(number)
        elif any(k in record and not _is_step(record[k]) for k in _STEP_FIELDS):
            bad_steps.append(number)
        else:
            records.append(record)
    if unreadable:
        logger.warning(
            "%s: ignored line(s) %s: not a JSON object as lmforge writes (a damaged or hand-edited file).",
            path,
            _line_list(unreadable),
        )
    if bad_steps:
        logger.warning(
            "%s: ignored line(s) %s: 'step' / 'to_step' is not a whole number.", path, _line_list(bad_steps)
        )
    return records


def _line_list(numbers: list[int], shown: int = 10) -> str:
    text = ", ".join(str(n) for n in numbers[:shown])
    return text + (f" and {len(numbers) - shown} more" if len(numbers) > shown else "")


def split_rollbacks(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the step records of the run as it finally went, the rollback events).

    A rollback to step ``t`` undoes the steps after ``t`` that were recorded before it; the curve rules
    judge the steps that made the final model (the rollback rule reports the undone ones).
    """
    steps: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for r in records:
        if r.get("event") == "rollback":
            events.append(r)
            to_step = int(r.get("to_step", 0))
            steps = [m for m in steps if int(m.get("step", 0)) <= to_step]
        elif "event" not in r:
            steps.append(r)
    return steps, events


def _read_yaml(path: Path) -> dict[str, Any]:
    from lmforge.config.yaml_io import read_yaml_file

    data = read_yaml_file(path)
    return data if isinstance(data, dict) else {}


def _latest_checkpoint(config: dict[str, Any], run_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    save_path = (
        (config.get("checkpoint") or {}).get("save_path")
        if isinstance(config.get("checkpoint"), dict)
        else None
    )
    candidates = [Path(save_path)] if save_path else []
    candidates.append(run_dir / "checkpoints")
    for base in candidates:
        if not base.is_dir():
            continue
        iterations = sorted(p for p in base.glob("iteration_*") if (p / "common.json").is_file())
        if iterations:
            path = iterations[-1] / "common.json"
            try:
                return json.loads(path.read_text()), iterations[-1]
            except (OSError, json.JSONDecodeError):
                return None, None
    return None, None


def read_run_dir(path: str | Path) -> RunEvidence:
    """Everything the doctor can use from a run directory (missing pieces are simply absent)."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise LmforgeError(
            f"lmforge doctor: {run_dir} is not a directory; give the run's output_dir (the directory "
            "holding metrics.jsonl and train.log)."
        )
    ev = RunEvidence()
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        ev.metrics, ev.rollbacks = split_rollbacks(_read_jsonl(metrics))
        ev.sources.append(str(metrics))
    log = run_dir / "train.log"
    if log.is_file():
        ev.log_lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        ev.sources.append(str(log))
    config = run_dir / CONFIG_FILE
    if config.is_file():
        ev.config = _read_yaml(config)
        ev.sources.append(str(config))
    facts = run_dir / FACTS_FILE
    if facts.is_file():
        ev.facts = _read_facts(facts)
        ev.sources.append(str(facts))
    ev.checkpoint, ckpt_dir = _latest_checkpoint(ev.config, run_dir)
    if ckpt_dir is not None:
        ev.sources.append(str(ckpt_dir / "common.json"))
        if not ev.config and (ckpt_dir / CONFIG_FILE).is_file():
            ev.config = _read_yaml(ckpt_dir / CONFIG_FILE)
            ev.sources.append(str(ckpt_dir / CONFIG_FILE))
    monitor = run_dir / "monitor"
    for f in sorted(monitor.glob("tokens_per_expert_rank*.jsonl")) if monitor.is_dir() else []:
        for r in _read_jsonl(f):
            if isinstance(r.get("tpe"), list) and "layer" in r:
                ev.tokens_per_expert.setdefault(int(r["layer"]), []).append([int(x) for x in r["tpe"]])
        ev.sources.append(str(f))
    for f in sorted(monitor.glob("train_state_rank*.jsonl")) if monitor.is_dir() else []:
        rank = int("".join(c for c in f.stem.rsplit("rank", 1)[-1] if c.isdigit()) or 0)
        losses = [
            float(r["local_loss"]) for r in _read_jsonl(f) if isinstance(r.get("local_loss"), (int, float))
        ]
        if losses:
            ev.rank_losses[rank] = losses
            ev.sources.append(str(f))
    if not ev.metrics and not ev.log_lines:
        raise LmforgeError(
            f"lmforge doctor: {run_dir} holds neither metrics.jsonl nor train.log; give the run's output_dir "
            "(the directory `lmforge train` wrote them to)."
        )
    return ev
