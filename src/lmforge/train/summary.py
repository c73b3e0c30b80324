"""The run's summary: what the log prints at the end and ``summary.json`` holds."""

from __future__ import annotations

import time
from typing import Any

from lmforge.train.checkpoint import read_tracker


def _status(trainer: Any) -> str:
    reason = trainer.stop_agreement.reason or ""
    if reason.startswith("diverged"):
        if "recovery." in reason:
            return "stopped: recovery could not repair the run"
        return "stopped: too many consecutive skipped steps"
    steps = trainer.run_steps
    if trainer.stop_agreement.stopping:
        if steps.none_applied:  # a stop asked for is no failure (the run is resumed later), but say it
            return f"stopped early ({reason}); no update applied: all {steps.taken} step(s) skipped"
        return f"stopped early ({reason})"
    if steps.none_applied:  # Trainer.fit raises the error with the reasons (train/run_outcome.py)
        return f"failed: no update applied: all {steps.taken} step(s) skipped"
    return "completed"


def run_summary(trainer: Any) -> dict[str, Any]:
    s = trainer.state
    elapsed = time.perf_counter() - trainer._run_started if trainer._run_started else 0.0
    ck = trainer.checkpoint_cfg
    latest = read_tracker(ck.save_path) if ck.enable_save and ck.save_path else None
    out = {
        "status": _status(trainer),
        "steps": f"{s.global_step}/{s.max_steps}",
        "time": fmt_seconds(elapsed),
        "tokens (this run)": f"{trainer._run_tokens:,}",
        "tokens/s (this run)": f"{trainer._run_tokens / elapsed:,.0f}" if elapsed > 0 else "n/a",
        "final loss": f"{s.last_loss:.6f}",
        "best loss": f"{s.best_loss:.6f}",
        "skipped steps": s.skipped_steps,  # the whole run's, steps before a resume included
        "skipped steps (this run)": trainer.run_steps.summary_line(),
        "resumed from": trainer.resumption.resumed_from or "-",
        "checkpoints": f"{ck.save_path} (latest: iteration {latest})" if latest is not None else "-",
        "metrics": str(trainer.output_dir / "metrics.jsonl"),
    }
    trailing = trainer.run_steps.trailing_line()
    if trailing is not None:  # the run trained, but its last steps did not move the weights
        out["last steps skipped"] = trailing
    recovery = trainer._recovery
    if recovery is not None:  # train/recovery/: rollbacks of the whole run (also before a restart)
        out["rollbacks"] = recovery.rollbacks
    if trainer.final_save is not None:  # the save after the loop (train/callbacks/checkpointing.py)
        step, seconds = trainer.final_save
        out["final checkpoint save"] = f"step {step}, {seconds:.2f} s"
    for key in ("log", "curves", "best validation"):
        if key in trainer.artifacts:
            out[key] = trainer.artifacts[key]
    return out


def fmt_seconds(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    h, m = divmod(int(m), 60)
    return f"{h:d}:{m:02d}:{s:05.2f}"
