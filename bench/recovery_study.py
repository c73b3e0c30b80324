"""Recovery study (docs/study.md, "Self-healing training"): what an injected fault costs with recovery off,
with skipping alone (the peers' behaviour), and with rollback + skip / rollback + replay.

One dense Qwen3-style model of >= 20M parameters, fp32, trained through lmforge's public path
(``load_config`` -> ``build_trainer`` -> ``fit``) on learnable synthetic token sequences. Two faults:

* a **corrupted batch**: the global batch of one step has random token ids as inputs and labels (a
  corrupt shard, a tokenizer mix-up); it is part of the data, so it comes back when that step is replayed;
* a **corrupted update**: the final norm's weights are multiplied by 50 right after one update (silent data
  corruption in the optimizer step, a flipped exponent bit); the data are fine.

Each is run four ways: ``off`` (no recovery, no spike skipping), ``skip_only`` (monitor.health_checkpoint:
an update whose gradient norm exceeds 3x the largest clean norm is skipped, 10 skips in a row stop),
``rollback_skip`` and ``rollback_replay`` (recovery.enable with data skip / replay). Reported per run:
its status, the validation loss of the final model (the same held-out batches for every run), the
compute lost (tokens trained on whose update did not reach the final model: undone by a rollback or
skipped), the samples stepped over, and the wall time beyond the clean run's.

    PYTHONPATH=src python bench/recovery_study.py [--steps 24] [--out /tmp/recovery_study]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.config import load_config
from lmforge.data import IndexedDatasetWriter
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import TrainerCallback, read_metrics

VOCAB = 32_000
SEQ = 128
USED = 512  # the documents use token ids 1..511 only: the model learns that in a few steps, so the loss
# falls well below ln(VOCAB) early, and a batch of random ids over the whole vocabulary is a clear spike


def write_data(prefix: Path) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(3000):
            start, step, n = int(rng.integers(1, USED)), int(rng.integers(1, 7)), int(rng.integers(60, 400))
            writer.add_document([1 + (start + step * i) % (USED - 1) for i in range(n)] + [0])


def base_config(root: Path, steps: int) -> dict[str, Any]:
    return {
        "training": {
            "steps": steps,
            "local_batch_size": 4,
            "global_batch_size": 4,
            "seed": 5,
            "max_norm": 1.0,
        },
        "optimizer": {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
        "lr_scheduler": {
            "type": "CosineWithWarmUpLR",
            "learning_rate": 3e-3,
            "warmup_steps": 3,
            "lr_end": 3e-4,
        },
        "checkpoint": {"enable_save": True, "save_interleaved_steps": 4, "save_max": 2},
        "model": {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            "num_hidden_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 1024,
            "vocab_size": VOCAB,
            "seq_length": SEQ,
            "compute_dtype": "float32",
        },
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "datasets_type": "GPTDataset",
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": True,
                "config": {
                    "seq_length": SEQ,
                    "eod": 0,
                    "data_path": [str(root / "data" / "docs")],
                    "split": "95,5,0",
                    "create_attention_mask": False,
                    "path_to_cache": str(root / "cache"),
                },
            },
            "num_parallel_workers": 0,
        },
        "eval_interval": steps,  # the final model's validation loss, on the same held-out batches every run
        "eval_steps": 4,
        "monitor": {"doctor": {"enable": False}},
    }


MODES: dict[str, dict[str, Any]] = {
    "off": {},
    "skip_only": {
        "monitor": {"health_checkpoint": {"global_norm_skip_time": 10}}
    },  # threshold set at run time
    "rollback_skip": {"recovery": {"enable": True, "data": "skip"}},
    "rollback_replay": {"recovery": {"enable": True, "data": "replay"}},
}


class CorruptBatch:
    """Wraps the training loader: the micro-batch of global step ``step`` gets random token ids."""

    def __init__(self, inner: Any, step: int) -> None:
        self.inner, self.step = inner, step

    def __iter__(self) -> CorruptBatch:
        iter(self.inner)
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.inner)
        if self.inner.consumed_samples // self.inner.samples_per_step == self.step:
            g = torch.Generator().manual_seed(1234)
            batch = dict(batch)
            shape = batch["input_ids"].shape
            batch["input_ids"] = torch.randint(1, VOCAB, shape, generator=g)
            batch["labels"] = torch.randint(1, VOCAB, shape, generator=g)
        return batch

    def __len__(self) -> int:
        return len(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


class CorruptUpdate(TrainerCallback):
    """Multiplies the final norm's weights by 50 after update ``step`` (once: the fault is transient)."""

    order = 70  # before the checkpoint callback: a save of that step holds the damage

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and not self.done:
            self.done = True
            with torch.no_grad():
                for name, p in kwargs["model"].named_parameters():
                    if "final_layernorm" in name:
                        p.mul_(50.0)


def train(root: Path, name: str, raw: dict[str, Any], fault: str | None, at: int) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    # Each mode starts from nothing: an earlier study's checkpoints (or the give-up marker of a mode that gave up,
    # which refuses a run saving there) must not change this one.
    shutil.rmtree(root / name, ignore_errors=True)
    raw["output_dir"] = str(root / name)
    raw["checkpoint"]["save_path"] = str(root / name / "ckpt")
    trainer = build_trainer(load_config(raw), device="cpu")
    if fault == "batch":
        factory = trainer.dataloader_factory
        trainer.dataloader_factory = lambda consumed: CorruptBatch(factory(consumed), at)
    elif fault == "update":
        trainer.callbacks.add(CorruptUpdate(at))
    t0 = time.perf_counter()
    status = "completed"
    try:
        trainer.fit()
    except Exception as exc:  # a run that gives up is a result here
        if type(exc).__name__ != "TrainingStopped":
            raise
        status = f"stopped at step {trainer.state.global_step}"
    wall = time.perf_counter() - t0
    return summarize(root / name, status, wall)


def summarize(run: Path, status: str, wall: float) -> dict[str, Any]:
    """A run's figures from its metrics.jsonl. Lost work is what did not reach the final model: the steps a
    rollback undid (their tokens and step time, the checkpoint saves among them, the restore itself and the
    save of the restored state that follows it) and the steps skipped without an update. Timing it step by
    step keeps it apart from the shared machine's noise in the total wall time."""
    records = read_metrics(run / "metrics.jsonl")
    events = [r for r in records if r.get("event") == "rollback"]
    kept: dict[int, dict[str, Any]] = {}
    undone: list[dict[str, Any]] = []
    for r in records:
        if r.get("event") == "rollback":
            undone += [v for s, v in kept.items() if s > r["to_step"]]
            kept = {s: v for s, v in kept.items() if s <= r["to_step"]}
        elif "step" in r:
            kept[r["step"]] = r
    skipped = [r for r in kept.values() if r.get("skipped")]

    def seconds(rs: list[dict[str, Any]]) -> float:
        return sum(float(r.get("step_time", 0)) + float(r.get("checkpoint_save_s", 0) or 0) for r in rs)

    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "status": status,
        "val_loss": val[-1] if val and status == "completed" else None,
        "final_train_loss": kept[max(kept)]["loss"] if kept else None,
        "rollbacks": len(events),
        "tokens_lost": sum(int(r.get("num_tokens", 0)) for r in undone + skipped),
        "samples_stepped_over": sum(
            e["skipped_samples"][1] - e["skipped_samples"][0] + 1 for e in events if e.get("skipped_samples")
        ),
        "skipped_steps": len(skipped),
        "time_lost_s": round(
            seconds(undone + skipped)
            + sum(float(e.get("restore_s", 0)) + float(e.get("save_s", 0)) for e in events),
            1,
        ),
        "wall_s": round(wall, 1),
        "max_grad_norm": max(
            (r["grad_norm"] for r in kept.values() if isinstance(r.get("grad_norm"), float)), default=None
        ),
        "events": [
            {k: e[k] for k in ("step", "to_step", "reason", "skipped_samples", "replayed_samples")}
            for e in events
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--at", type=int, default=14, help="the step of the fault")
    p.add_argument("--out", default="/tmp/recovery_study")
    p.add_argument("--only", default="", help="comma-separated fault:mode pairs to run (default: all)")
    p.add_argument("--resummarize", action="store_true", help="recompute the figures of --out's runs")
    a = p.parse_args()
    if a.resummarize:
        resummarize(Path(a.out))
        return
    torch.set_num_threads(1)  # on a busy shared CPU one thread is several times faster (docs/study.md)
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "data" / "docs.bin").exists():
        (root / "data").mkdir(exist_ok=True)
        write_data(root / "data" / "docs")
    raw = base_config(root, a.steps)
    results: dict[str, Any] = {}
    clean = train(root, "clean", raw, None, a.at)
    results["clean"] = clean
    params = sum(
        p.numel()
        for p in build_trainer(
            load_config({**raw, "output_dir": str(root / "count"), "checkpoint": {"enable_save": False}}),
            device="cpu",
        ).model.parameters()
    )
    results["parameters"] = params
    threshold = 3 * clean["max_grad_norm"]
    print(json.dumps({"clean": clean, "parameters": params}), flush=True)
    for fault in ("batch", "update"):
        for mode, changes in MODES.items():
            if a.only and f"{fault}:{mode}" not in a.only.split(","):
                continue
            cfg = copy.deepcopy(raw)
            for section, values in changes.items():
                cfg.setdefault(section, {}).update(copy.deepcopy(values))
            if mode == "skip_only":
                cfg["monitor"]["health_checkpoint"]["global_norm_skip_threshold"] = threshold
            out = train(root, f"{fault}_{mode}", cfg, fault, a.at)
            out["wall_lost_s"] = round(out["wall_s"] - clean["wall_s"], 1)
            results[f"{fault}:{mode}"] = out
            print(json.dumps({f"{fault}:{mode}": out}), flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {root / 'results.json'}")


def resummarize(root: Path) -> None:
    results = json.loads((root / "results.json").read_text())
    clean_wall = results["clean"]["wall_s"]
    for key, old in results.items():
        if isinstance(old, dict) and "status" in old:
            new = summarize(root / key.replace(":", "_"), old["status"], old["wall_s"])
            if key != "clean":
                new["wall_lost_s"] = round(new["wall_s"] - clean_wall, 1)
            results[key] = new
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
