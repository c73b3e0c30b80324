"""Looking at a schedule: the lr at its key steps, a CSV of every step, and a plot."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.lr.schedules import Schedule
from lmforge.utils.atomic import atomic_file

# Above this many steps the plot samples the curve (boundaries are always included); the CSV never does.
_MAX_PLOTTED_POINTS = 20_000


@dataclass(frozen=True)
class LabelledSchedule:
    label: str  # e.g. the config file it came from
    schedule: Schedule
    total_steps: int


def key_steps(schedule: Schedule, total_steps: int) -> list[tuple[int, str]]:
    """(step, what happens there) for the start, each boundary and the step before it, quarters, the end."""
    names: dict[int, list[str]] = {}

    def mark(step: int, name: str = "") -> None:
        if 0 <= step <= total_steps:
            names.setdefault(step, [])
            if name and name not in names[step]:
                names[step].append(name)

    mark(0, "first update")
    mark(1)
    for name, step in schedule.boundaries().items():
        mark(step - 1)
        mark(step, name)
    for quarter in (1, 2, 3):
        mark(total_steps * quarter // 4)
    mark(total_steps - 1, "last update")
    mark(total_steps, "after the last update")
    return [(step, ", ".join(names[step])) for step in sorted(names)]


def format_key_steps(item: LabelledSchedule) -> str:
    lines = [f"{item.label}: {item.schedule.description} (training.steps {item.total_steps})"]
    lines += [f"  warning: {w}" for w in item.schedule.warnings]
    lines.append(f"  {'step':>10}  {'lr':<14}")
    for step, name in key_steps(item.schedule, item.total_steps):
        lines.append(f"  {step:>10}  {item.schedule.lr_at(step):<14.6e}  {name}".rstrip())
    return "\n".join(lines)


def write_csv(items: Sequence[LabelledSchedule], path: str | Path) -> None:
    """``step,lr`` for every step 0..training.steps; with several schedules, ``config,step,lr``."""
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        several = len(items) > 1
        writer.writerow(["config", "step", "lr"] if several else ["step", "lr"])
        for item in items:
            for step in range(item.total_steps + 1):
                value = f"{item.schedule.lr_at(step):.17g}"  # round-trips the float64 exactly
                writer.writerow([item.label, step, value] if several else [step, value])


def _plotted_steps(item: LabelledSchedule) -> list[int]:
    total = item.total_steps
    if total + 1 <= _MAX_PLOTTED_POINTS:
        return list(range(total + 1))
    stride = total / (_MAX_PLOTTED_POINTS - 1)
    steps = {round(i * stride) for i in range(_MAX_PLOTTED_POINTS)}
    for step in item.schedule.boundaries().values():
        steps.update(s for s in (step - 1, step) if 0 <= s <= total)
    return sorted(steps)


def plot(items: Sequence[LabelledSchedule], path: str | Path) -> None:
    """Draw each schedule over 0..training.steps with its boundaries marked as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    try:
        labels: dict[int, list[str]] = {}  # one label per step, so coinciding boundaries stay readable
        label_colors: dict[int, str] = {}
        for index, item in enumerate(items):
            color = f"C{index % 10}"
            steps = _plotted_steps(item)
            ax.plot(steps, [item.schedule.lr_at(s) for s in steps], color=color, label=item.label)
            for name, step in item.schedule.boundaries().items():
                if 0 < step <= item.total_steps:
                    ax.axvline(step, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
                    names = labels.setdefault(step, [])
                    if name not in names:
                        names.append(name)
                    label_colors.setdefault(step, color)
        for step, names in labels.items():
            ax.annotate(
                f"{' / '.join(names)} ({step})",
                xy=(step, 0.98),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=label_colors[step] if len(items) > 1 else "0.3",
            )
        ax.set_xlabel("step (update k uses the lr at step k - 1)")
        ax.set_ylabel("learning rate")
        title = items[0].schedule.type_name if len(items) == 1 else "learning-rate schedules"
        ax.set_title(title)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
