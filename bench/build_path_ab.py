"""Single-device training step of the old build path against this tree's, in one process, same weights.

    .venv/bin/python bench/build_path_ab.py --before 46f3119 [--models demo,100m] [--processes 4]
        [--rounds 100,30] [--loss-chunk N]

Issue 14 asks that the one build path (meta build, FSDP2 over the one process with fp32 parameters, bf16
compute) not lower single-device throughput against the Hugging Face loop, "both commits side by side in
one run". ``bench/compare_trees.py`` runs each tree's ``bench/train.py`` in its own process; there each
tree's HF loop trains the weights that tree initialises, in a process whose allocator state that tree's
model shaped, and the peer's own speed moved by more than the difference sought (docs/benchmarks.md,
"One build path", session 7). Here one process holds three contestants:

* ``before``: the ``--before`` commit's ``src/lmforge`` (the old build path: bf16 parameters, fp32
  masters in the optimizer, ``main_grad`` hooks), extracted with ``git archive`` and imported as the
  package ``lmforge_before``; its own ``build_model``, ``load_hf_weights``, ``build_optimizer`` and
  ``TrainStep``;
* ``now``: this tree, through ``bench/train.py``'s ``lmforge_runner`` (the trainer's build path);
* ``hf``: ``bench/train.py``'s Hugging Face loop (fp32 parameters under bf16 autocast, fused AdamW).

All three train **the same initial weights** (this tree's init, exported with ``save_hf_pretrained`` and
loaded by the other two) on the same batch with the same AdamW hyper-parameters and clipping at 1.0.
Their steps alternate in rotating order (``before now hf``, ``now hf before``, ...), so drifts of the
machine hit all three alike. Each worker process reports every step's wall and CPU time; the parent runs
``--processes`` workers per model (half of them building ``before`` first, since where a model's buffers
land in the heap moves kernel times by a few percent) and pools them.

Reported per model: the median step of each contestant, and the speed ratios ``now / before``,
``before / hf`` and ``now / hf`` as the median over rounds of the per-round ratio (each round's steps ran
back to back) with its interquartile range, per worker and pooled; pooled also by CPU time (the process's
CPU seconds per step, which time stolen by other work on the machine does not inflate). Both loops run under lmforge's
allocator defaults (``utils/malloc.py``) and ``OMP_WAIT_POLICY=PASSIVE``, as ``lmforge train`` runs.

Each tree trains with its own default loss unless ``--loss-chunk N`` sets ``model.loss_chunk_size`` for both
(the old tree's default was the plain loss, 0; this tree's is chunks of 512, a memory feature that came with
another change): ``--loss-chunk 0`` and ``--loss-chunk 512`` compare the build paths like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmforge.config import validate_section

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lmforge_before"
CONTESTANTS = ("before", "now", "hf")


def extract_before(commit: str, dest: Path) -> Path:
    """``src/lmforge`` of ``commit`` as the package ``lmforge_before`` under ``dest`` (returned: the
    directory to put on ``sys.path``). Every ``lmforge`` word in its sources is renamed, so it imports
    itself and never this tree's package."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "src/lmforge"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"--before {commit!r}: git archive failed: {archive.stderr.decode().strip()}")
    raw = dest / "raw"
    raw.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(raw)], input=archive.stdout, check=True)
    root = dest / "pkg"
    word = re.compile(r"\blmforge\b")
    for src in (raw / "src" / "lmforge").rglob("*"):
        out = root / PACKAGE / src.relative_to(raw / "src" / "lmforge")
        if src.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif src.suffix == ".py":
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(word.sub(PACKAGE, src.read_text()))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
    return root


def before_model(section: dict):
    """The old build path's model (bf16 parameters), on its own init until weights are loaded."""
    try:
        from lmforge_before.models import build_model
    except ImportError as e:
        raise SystemExit(f"--before: cannot import that commit's lmforge ({e})") from e
    return build_model(validate_section("model", {k: v for k, v in section.items() if k != "batch"}))


def before_runner(model, batch: dict, hf_dir: Path):
    """The old build path's single-device step, on the weights in ``hf_dir``."""
    try:
        from lmforge_before.models import load_hf_weights
        from lmforge_before.optim import build_optimizer
        from lmforge_before.train.parallel_seam import ParallelContext
        from lmforge_before.train.step import TrainStep
    except ImportError as e:
        raise SystemExit(
            f"--before: that commit lacks the old build path's API ({e}); give a commit before the one "
            "build path, e.g. 46f3119."
        ) from e
    import train as B

    load_hf_weights(model, hf_dir)
    opt = build_optimizer(B.ADAMW, model, B.LR)
    step = TrainStep(model, opt, None, max_norm=1.0, ctx=ParallelContext())
    return lambda: step([batch])


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.before_path)
    sys.path.insert(0, str(REPO / "bench"))
    from lmforge.utils import malloc

    malloc.apply_malloc_defaults()
    import torch

    import train as B
    from lmforge.models import save_hf_pretrained

    section = dict(B.MODELS[args.model])
    if args.loss_chunk is not None:
        section["loss_chunk_size"] = args.loss_chunk  # both trees: like for like
    b, s = section["batch"], section["seq_length"]
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, section["vocab_size"], (b, s + 1), generator=g)
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].clone()}
    runs = {}
    tmp = tempfile.mkdtemp(prefix="build_path_ab_")
    try:
        hf_dir = Path(tmp) / "hf"
        # Which model's buffers are allocated first moves kernel times by a few percent; the parent
        # alternates it between workers.
        old_model = before_model(section) if args.before_first else None
        now_model, _, runs["now"] = B.lmforge_runner(section, batch)
        save_hf_pretrained(now_model, hf_dir)
        old_model = before_model(section) if old_model is None else old_model
        runs["before"] = before_runner(old_model, batch, hf_dir)
        _, runs["hf"] = B.hf_runner(now_model, {**batch, "full": full[:, :-1]}, Path(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    first = {}
    for k, f in runs.items():
        out = f()
        first[k] = float(out.loss if hasattr(out, "loss") else out)
    if max(first.values()) - min(first.values()) > 0.01 * abs(first["hf"]):
        raise SystemExit(f"first-step losses differ: {first} (not the same weights and batch?)")
    for f in runs.values():  # a second warm-up step: the optimizers' states exist from here on
        f()
    times = {k: [] for k in CONTESTANTS}
    cpu = {k: [] for k in CONTESTANTS}
    for i in range(int(args.rounds)):
        order = CONTESTANTS[i % 3 :] + CONTESTANTS[: i % 3]
        for k in order:
            t0, c0 = time.perf_counter(), time.process_time()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    print(json.dumps({"first_loss": first, "wall": times, "cpu": cpu}))


def ratios(times: dict, a: str, b: str) -> list[float]:
    """Per-round speed of ``a`` against ``b`` (time of b / time of a: above 1, a is faster)."""
    return [tb / ta for ta, tb in zip(times[a], times[b])]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="46f3119", help="a commit with the old build path")
    p.add_argument("--models", default="demo,100m")
    p.add_argument("--rounds", default="100,30", help="rounds per worker, one value or one per model")
    p.add_argument("--processes", type=int, default=4, help="workers per model")
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=None,
        help="model.loss_chunk_size for both trees (default: each tree's own default; the old tree's was 0)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--before-path", help=argparse.SUPPRESS)
    p.add_argument("--before-first", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.loss_chunk is not None and args.loss_chunk < 0:
        raise SystemExit(
            f"--loss-chunk: tokens per loss chunk, 0 (the plain loss) or more; got {args.loss_chunk}"
        )
    models = args.models.split(",")
    rounds = [int(r) for r in args.rounds.split(",")]
    if len(rounds) == 1:
        rounds *= len(models)
    if len(rounds) != len(models):
        raise SystemExit(f"--rounds: give one value or one per model ({len(models)}), got {args.rounds!r}")
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True, text=True
    )
    now_name = commit + (" + uncommitted changes" if dirty.stdout.strip() else "")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO / "src"))
    with tempfile.TemporaryDirectory() as tmp:
        before_path = extract_before(args.before, Path(tmp))
        loss = (
            "each tree's default"
            if args.loss_chunk is None
            else f"model.loss_chunk_size {args.loss_chunk} in both"
        )
        print(f"before = {args.before} (as {PACKAGE}), now = {now_name}; loss: {loss}", flush=True)
        for model, n_rounds in zip(models, rounds):
            pooled = {k: [] for k in CONTESTANTS}
            pooled_cpu = {k: [] for k in CONTESTANTS}
            print(f"\n### {model}: {args.processes} processes x {n_rounds} rounds\n")
            print(
                "| process | built first | median step before / now / hf (ms) | now / before | before / hf | now / hf | load |"
            )
            print("|---:|---|---|---:|---:|---:|---:|")
            for proc in range(args.processes):
                cmd = [sys.executable, __file__, "--worker", "--model", model, "--rounds", str(n_rounds)]
                cmd += ["--before-path", str(before_path)]
                if args.loss_chunk is not None:
                    cmd += ["--loss-chunk", str(args.loss_chunk)]
                before_first = proc % 2 == 1
                if before_first:
                    cmd.append("--before-first")
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"worker failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                wall = res["wall"]
                for k in CONTESTANTS:
                    pooled[k] += wall[k]
                    pooled_cpu[k] += res["cpu"][k]
                med = {k: 1e3 * statistics.median(wall[k]) for k in CONTESTANTS}
                cells = [
                    statistics.median(ratios(wall, a, b))
                    for a, b in (("now", "before"), ("before", "hf"), ("now", "hf"))
                ]
                load = os.getloadavg()[0]
                print(
                    f"| {proc + 1} | {'before' if before_first else 'now'} | "
                    f"{med['before']:,.0f} / {med['now']:,.0f} / {med['hf']:,.0f} | "
                    + " | ".join(f"{c:.3f}" for c in cells)
                    + f" | {load:.1f} |",
                    flush=True,
                )
            print()
            for a, b in (("now", "before"), ("before", "hf"), ("now", "hf")):
                q1, m, q3 = quartiles(ratios(pooled, a, b))
                c1, cm, c3 = quartiles(ratios(pooled_cpu, a, b))
                print(
                    f"pooled {a} / {b}: median of per-round speed ratios {m:.3f} (IQR {q1:.3f}-{q3:.3f}); "
                    f"by CPU time {cm:.3f} (IQR {c1:.3f}-{c3:.3f})"
                )
            meds = {k: 1e3 * statistics.median(pooled[k]) for k in CONTESTANTS}
            print(
                "pooled median step (ms): " + ", ".join(f"{k} {v:,.0f}" for k, v in meds.items()), flush=True
            )


if __name__ == "__main__":
    main()
