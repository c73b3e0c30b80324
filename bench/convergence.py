"""Convergence study: Muon vs AdamW on a small DeepSeek-V3-style (MLA + MoE) and a Qwen3-style model.

Every run goes through lmforge's public trainer API (``load_config`` + ``build_trainer`` + ``fit``),
so it exercises the same code as ``lmforge train``. For each model and optimizer the peak learning
rate is chosen by a sweep over a grid (all runs: same steps, batch, data order and seed, so every
run sees the same tokens in the same order), and validation loss on the demo corpus's ``valid``
split is recorded every ``--eval-interval`` steps.

Optimizer sections come from the shipped recipes (the spec's): ``configs/pretrain_adamw.yaml`` for
AdamW and ``configs/muon_deepseek_v3.yaml`` for Muon. Both optimizers share one schedule (cosine with
warm-up, see ``--warmup-ratio``), so the comparison is about the update rule, not the schedule (the
Muon recipe's constant lr would hand AdamW the cosine's end-of-run drop).

Report (stdout, ``OUTPUT/report.md``, ``OUTPUT/results.json``) and one PNG per model
(``PLOTS/convergence_<model>.png``): the best run of each optimizer's validation curve, its final
validation loss, and the tokens each needs to reach AdamW's final validation loss (linear
interpolation between evaluations). Runs already finished under ``OUTPUT`` are reused (``--fresh``
re-runs them), so an interrupted study continues where it stopped.

CPU (the default sizing: 18 runs, 24 minutes of run time measured on 2 shared, busy cores):
    lmforge data demo && python bench/convergence.py
GPU, larger, on your own data (see docs/study.md):
    python bench/convergence.py --device cuda --threads 0 --train-prefix data/my_train_text_document \\
        --valid-prefix data/my_valid_text_document --vocab-size 151936 --eod 151643 --hidden 512 --layers 8 \\
        --seq 1024 --batch 32 --steps 4000 --eval-interval 200 --eval-batches 32 \\
        --output-dir output/convergence_gpu --plot-dir output/convergence_gpu
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"adamw": "configs/pretrain_adamw.yaml", "muon": "configs/muon_deepseek_v3.yaml"}
MODELS = ("deepseek_v3", "qwen3")
LABELS = {
    "adamw": "AdamW",
    "muon": "Muon",
    "deepseek_v3": "DeepSeek-V3-style (MLA + MoE)",
    "qwen3": "Qwen3-style (dense)",
}


@dataclass
class RunResult:
    model: str
    optimizer: str
    lr: float
    status: str  # "completed", "failed: ..."
    tokens_per_step: int
    steps: int
    params: int = 0
    wall_s: float = 0.0
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val_loss)
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)

    @property
    def final_val(self) -> float:
        if self.status != "completed" or not self.val or self.val[-1][0] != self.steps:
            return math.inf
        loss = self.val[-1][1]
        return loss if math.isfinite(loss) else math.inf

    @property
    def name(self) -> str:
        return run_name(self.model, self.optimizer, self.lr)


def run_name(model: str, optimizer: str, lr: float) -> str:
    return f"{model}_{optimizer}_lr{lr:g}"


# -- configs ------------------------------------------------------------------------------------


def model_section(kind: str, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """A small model of each family; sizes scale with --hidden / --layers (head size 32)."""
    h = args.hidden
    heads = max(h // 32, 1)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": h,
        "intermediate_size": 3 * h,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "max_position_embeddings": max(2 * args.seq, 256),
        "seq_length": args.seq,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "compute_dtype": args.dtype,
        "params_dtype": "float32",
    }
    if kind == "qwen3":
        return {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            **common,
            "num_key_value_heads": max(heads // 2, 1),
            "head_dim": 32,
            "tie_word_embeddings": True,
        }
    if kind == "deepseek_v3":
        return {
            "model_type": "deepseek_v3",
            "architectures": "DeepseekV3ForCausalLM",
            **common,
            "tie_word_embeddings": True,
            # MLA: compressed queries and keys/values, decoupled rotary part.
            "q_lora_rank": 3 * h // 4,
            "kv_lora_rank": h // 2,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            # MoE: 8 routed experts, 2 per token, one shared expert, first layer dense,
            # aux-loss-free balancing (expert bias) as DeepSeek-V3.
            "n_routed_experts": args.experts,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 3 * h // 4,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "num_nextn_predict_layers": 0,  # no MTP: the study compares the language-model loss only
        }
    raise ValueError(kind)


def recipe_optimizer(name: str) -> dict[str, Any]:
    with open(REPO / RECIPES[name]) as f:
        return dict(yaml.safe_load(f)["optimizer"])


def run_config(model: str, optimizer: str, lr: float, args: argparse.Namespace, vocab_size: int) -> dict:
    return {
        "output_dir": str(Path(args.output_dir) / run_name(model, optimizer, lr)),
        "checkpoint": {"enable_save": False, "load_path": ""},
        "training": {
            "steps": args.steps,
            "local_batch_size": args.batch,
            "global_batch_size": args.batch,
            "max_norm": 1.0,
            "seed": args.seed,
            "deterministic": False,
        },
        "optimizer": recipe_optimizer(optimizer),
        "lr_scheduler": {
            "type": "CosineWithWarmUpLR",
            "learning_rate": lr,
            "warmup_ratio": args.warmup_ratio,
            "warmup_lr_init": 0.0,
            "lr_end": lr * args.lr_end_ratio,
        },
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "datasets_type": "GPTDataset",
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": True,
                "config": {
                    "seq_length": args.seq,
                    "eod": args.eod,
                    "pad": -1,
                    "create_attention_mask": False,
                    "create_compressed_eod_mask": False,
                    "train_data_path": [args.train_prefix],
                    "valid_data_path": [args.valid_prefix],
                },
            },
            "drop_remainder": True,
            "num_parallel_workers": 0,
        },
        "model": model_section(model, args, vocab_size),
        "eval_interval": args.eval_interval,
        "eval_steps": args.eval_batches,
        "callbacks": [],
    }


def data_vocab_size(args: argparse.Namespace) -> int:
    """--vocab-size, else the vocabulary of the tokenizer.json next to the training data, else 8192."""
    if args.vocab_size:
        return args.vocab_size
    tok = Path(args.train_prefix).parent / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer

        return int(Tokenizer.from_file(str(tok)).get_vocab_size())
    return 8192


# -- running ------------------------------------------------------------------------------------


def train_one(model: str, optimizer: str, lr: float, args: argparse.Namespace, vocab_size: int) -> RunResult:
    import torch

    from lmforge.config import load_config
    from lmforge.train.builder import build_trainer
    from lmforge.train.callbacks.metrics import read_metrics

    out = Path(args.output_dir) / run_name(model, optimizer, lr)
    cached = out / "result.json"
    if cached.is_file() and not args.fresh:
        return RunResult(**json.loads(cached.read_text()))
    tokens_per_step = args.batch * args.seq
    result = RunResult(model, optimizer, lr, "running", tokens_per_step, args.steps)
    if args.threads > 0:
        # Under oversubscription (a busy shared CPU) one thread is several times faster than two.
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        cfg = load_config(run_config(model, optimizer, lr, args, vocab_size))
        (out / "metrics.jsonl").unlink(missing_ok=True)
        trainer = build_trainer(cfg, output_dir=out, device=args.device)
        result.params = sum(p.numel() for p in trainer.model.parameters())
        summary = trainer.fit()
        if trainer.stop_agreement.requested and not str(trainer.stop_agreement.reason or "").startswith(
            "diverged"
        ):
            # SIGTERM/SIGINT: the trainer stopped cleanly; stop the study too, keeping finished runs.
            raise SystemExit(
                f"stopped ({trainer.stop_agreement.reason}); finished runs are kept under {args.output_dir}"
            )
        result.status = "completed" if summary.get("status", "completed") == "completed" else str(summary)
    except Exception as exc:  # a diverged or broken run is a result of the sweep, not the end of it
        result.status = f"failed: {type(exc).__name__}: {exc}"
    result.wall_s = time.perf_counter() - start
    records = read_metrics(out / "metrics.jsonl")
    result.train = [(int(r["step"]), _float(r.get("loss"))) for r in records if "loss" in r]
    result.val = [(int(r["step"]), _float(r["val_loss"])) for r in records if "val_loss" in r]
    out.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(asdict(result)))
    return result


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# -- analysis -----------------------------------------------------------------------------------


def tokens_to_reach(val: list[tuple[int, float]], target: float, tokens_per_step: int) -> float | None:
    """Tokens at which the validation curve first reaches ``target``, interpolated linearly between
    evaluations (the first evaluation is not interpolated from step 0); None if it never does."""
    prev: tuple[int, float] | None = None
    for step, loss in val:
        if math.isfinite(loss) and loss <= target:
            if prev is None or not math.isfinite(prev[1]) or prev[1] == loss:
                return float(step * tokens_per_step)
            frac = (prev[1] - target) / (prev[1] - loss)
            return (prev[0] + frac * (step - prev[0])) * tokens_per_step
        prev = (step, loss)
    return None


def best_runs(results: list[RunResult]) -> dict[str, RunResult]:
    """The lowest final validation loss per optimizer (ties: the smaller lr)."""
    best: dict[str, RunResult] = {}
    for r in sorted(results, key=lambda r: r.lr):
        if r.optimizer not in best or r.final_val < best[r.optimizer].final_val:
            best[r.optimizer] = r
    return best


def summarise(model: str, results: list[RunResult], grids: dict[str, list[float]]) -> dict[str, Any]:
    best = best_runs(results)
    target = best["adamw"].final_val if "adamw" in best else math.nan
    rows = []
    for opt, r in best.items():
        grid = grids[opt]
        edge = r.lr in (min(grid), max(grid)) and len(grid) > 1
        reach = tokens_to_reach(r.val, target, r.tokens_per_step) if math.isfinite(target) else None
        rows.append(
            {
                "optimizer": opt,
                "best_lr": r.lr,
                "lr_at_grid_edge": edge,
                "final_val_loss": r.final_val,
                "tokens": r.steps * r.tokens_per_step,
                "tokens_to_adamw_final": reach,
                "params": r.params,
            }
        )
    adam_tokens = next((x["tokens_to_adamw_final"] for x in rows if x["optimizer"] == "adamw"), None)
    for x in rows:
        t = x["tokens_to_adamw_final"]
        x["ratio_to_adamw"] = t / adam_tokens if t is not None and adam_tokens else None
    sweep = [
        {"optimizer": r.optimizer, "lr": r.lr, "final_val_loss": r.final_val, "status": r.status}
        for r in results
    ]
    return {"model": model, "target_val_loss": target, "best": rows, "sweep": sweep}


def plot_model(model: str, results: list[RunResult], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"adamw": "tab:blue", "muon": "tab:red"}
    best = best_runs(results)
    fig, (ax, sx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for r in sorted(results, key=lambda r: (r.optimizer, r.lr)):
        pts = [(s * r.tokens_per_step / 1e6, v) for s, v in r.val if math.isfinite(v)]
        if not pts:
            continue
        is_best = best.get(r.optimizer) is r
        ax.plot(
            *zip(*pts),
            color=colours.get(r.optimizer, "grey"),
            lw=2.2 if is_best else 0.9,
            ls="-" if is_best else ":",
            alpha=1.0 if is_best else 0.6,
            marker="o" if is_best else None,
            ms=3,
            label=f"{LABELS.get(r.optimizer, r.optimizer)} lr={r.lr:g}" + (" (best)" if is_best else ""),
        )
    target = summary["target_val_loss"]
    if math.isfinite(target):
        ax.axhline(target, color="grey", lw=0.8, ls="--", label=f"AdamW final {target:.3f}")
        for row in summary["best"]:
            if row["tokens_to_adamw_final"] is not None:
                ax.plot(
                    row["tokens_to_adamw_final"] / 1e6,
                    target,
                    "x",
                    color=colours.get(row["optimizer"]),
                    ms=10,
                )
    finite = [v for r in results for _, v in r.val if math.isfinite(v)]
    if finite:
        lo = min(finite)
        ax.set_ylim(lo - 0.1, min(max(finite), lo + 3.0))
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{LABELS.get(model, model)}: validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for opt in sorted({r.optimizer for r in results}):
        rs = sorted((r for r in results if r.optimizer == opt), key=lambda r: r.lr)
        sx.plot(
            [r.lr for r in rs],
            [r.final_val if math.isfinite(r.final_val) else float("nan") for r in rs],
            "o-",
            color=colours.get(opt, "grey"),
            label=LABELS.get(opt, opt),
        )
    sx.set_xscale("log")
    sx.set_xlabel("peak learning rate")
    sx.set_ylabel("final validation loss")
    sx.set_title("learning-rate sweep")
    sx.grid(alpha=0.3)
    sx.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_markdown(summaries: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> str:
    lines = [
        f"Steps {args.steps} x {args.batch} sequences x {args.seq} tokens = {args.steps * args.batch * args.seq:,} "
        f"training tokens per run; seed {args.seed}; device {args.device}; {wall_s / 60:.1f} min of training "
        "and evaluation in total (the sum over runs, including runs reused from an earlier invocation).",
        "",
        "| model | optimizer | params | best lr (grid) | final val loss | tokens to AdamW's final loss | vs AdamW |",
        "|---|---|---|---|---|---|---|",
    ]
    grids = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    for s in summaries:
        for row in s["best"]:
            t = row["tokens_to_adamw_final"]
            ratio = row["ratio_to_adamw"]
            grid = ", ".join(f"{x:g}" for x in grids[row["optimizer"]])
            edge = " (edge)" if row["lr_at_grid_edge"] else ""
            lines.append(
                f"| {s['model']} | {LABELS[row['optimizer']]} | {row['params'] / 1e6:.2f} M | {row['best_lr']:g}{edge} "
                f"({grid}) | {row['final_val_loss']:.4f} | "
                f"{f'{t:,.0f}' if t is not None else 'not reached'} | {f'{ratio:.2f}' if ratio is not None else '-'} |"
            )
    lines += [
        "",
        "Sweep (final validation loss):",
        "",
        "| model | optimizer | lr | final val loss | status |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        for x in s["sweep"]:
            lines.append(
                f"| {s['model']} | {LABELS[x['optimizer']]} | {x['lr']:g} | {x['final_val_loss']:.4f} | {x['status'][:60]} |"
            )
    return "\n".join(lines) + "\n"


# -- command line -------------------------------------------------------------------------------


def _lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default="data/demo", help="directory of `lmforge data demo` (train, valid, tokenizer)"
    )
    p.add_argument("--train-prefix", default=None, help="training dataset prefix (default: DATA/train)")
    p.add_argument("--valid-prefix", default=None, help="validation dataset prefix (default: DATA/valid)")
    p.add_argument("--vocab-size", type=int, default=0, help="model vocabulary (default: the tokenizer's)")
    p.add_argument("--eod", type=int, default=0, help="end-of-document token id (the demo tokenizer's: 0)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: deepseek_v3,qwen3")
    p.add_argument("--optimizers", default="adamw,muon", help="comma-separated: adamw,muon")
    p.add_argument(
        "--adamw-lrs", type=_lrs, default=_lrs("1e-3,2e-3,3e-3,5e-3,1e-2"), help="AdamW peak lr grid"
    )
    p.add_argument("--muon-lrs", type=_lrs, default=_lrs("3e-3,1e-2,3e-2,1e-1"), help="Muon peak lr grid")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (heads of 32)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--experts", type=int, default=8, help="routed experts of the MoE model")
    p.add_argument("--dtype", default="bfloat16", help="model.compute_dtype")
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--lr-end-ratio", type=float, default=0.1, help="lr_end as a fraction of the peak lr")
    p.add_argument("--eval-interval", type=int, default=15, help="validate every N steps")
    p.add_argument(
        "--eval-batches", type=int, default=6, help="validation micro-batches (the same ones each time)"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--output-dir", default="output/convergence", help="runs, results.json, report.md")
    p.add_argument("--plot-dir", default="docs/img", help="where convergence_<model>.png go")
    p.add_argument("--fresh", action="store_true", help="re-run runs that already have a result")
    args = p.parse_args(argv)
    args.train_prefix = args.train_prefix or str(Path(args.data) / "train")
    args.valid_prefix = args.valid_prefix or str(Path(args.data) / "valid")
    args.models = [m for m in args.models.split(",") if m]
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; valid: {', '.join(MODELS)}")
    for o in args.optimizers:
        if o not in RECIPES:
            p.error(f"--optimizers: unknown optimizer {o!r}; valid: {', '.join(RECIPES)}")
    if args.steps % args.eval_interval:
        p.error(
            "--steps must be a multiple of --eval-interval (the final loss is an evaluation at the last step)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for prefix in (args.train_prefix, args.valid_prefix):
        if not Path(prefix + ".idx").is_file():
            print(
                f"{prefix}.idx: no such dataset; build the demo one with: lmforge data demo", file=sys.stderr
            )
            return 2
    vocab = data_vocab_size(args)
    from lmforge.data import IndexedDataset

    train_tokens = IndexedDataset(args.train_prefix).num_tokens
    run_tokens = args.steps * args.batch * args.seq
    if run_tokens > train_tokens:
        print(
            f"note: each run reads {run_tokens:,} tokens, {run_tokens / train_tokens:.1f} passes over the "
            f"{train_tokens:,} training tokens of {args.train_prefix}; repeated data favours memorisation",
            flush=True,
        )
    grids = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    start = time.perf_counter()
    summaries = []
    all_results: list[RunResult] = []
    for model in args.models:
        results = []
        for opt in args.optimizers:
            for lr in grids[opt]:
                r = train_one(model, opt, lr, args, vocab)
                results.append(r)
                print(
                    f"[{(time.perf_counter() - start) / 60:5.1f} min] {r.name}: final val {r.final_val:.4f} "
                    f"({r.wall_s:.0f} s, {r.status[:80]})",
                    flush=True,
                )
        all_results += results
        summary = summarise(model, results, grids)
        summaries.append(summary)
        plot = Path(args.plot_dir) / f"convergence_{model}.png"
        plot_model(model, results, summary, plot)
        print(f"wrote {plot}", flush=True)
    wall = sum(r.wall_s for r in all_results)
    report = report_markdown(summaries, args, wall)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report)
    settings = {k: v for k, v in vars(args).items()}
    (out / "results.json").write_text(
        json.dumps({"settings": settings, "wall_s": wall, "models": summaries}, indent=1)
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
