"""``DownstreamEvalCallback``: lm-evaluation-harness tasks every N steps during training.

YAML (the ``callbacks:`` list)::

    callbacks:
      - type: DownstreamEvalCallback
        tasks: [data/tasks/tiny.jsonl, arc_easy]   # or "a,b"
        interval: 500          # every N steps (and never at step 0)
        limit: 200             # optional: items per task
        num_fewshot: 0         # optional
        include_path: ""       # optional: directory of harness task YAMLs
        tokenizer: ""          # optional: default the run data's tokenizer (as `lmforge generate`)
        batch_size: 8

Results go into the step's metrics as ``lm_eval/<task>/<metric>`` (so metrics.jsonl and the trackers
get them) and, from rank 0, into ``<output_dir>/lm_eval/step_XXXXXXXX.json``. Every rank runs the
same requests in lockstep (sharded data/tensor-parallel models need all ranks in each forward);
pipeline parallelism is refused. Needs the extra ``[eval]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, DataError
from lmforge.train.callbacks.base import TrainerCallback, logger
from lmforge.train.callbacks.lm_eval_harness import (
    _check_jsonl_task,
    evaluate_tasks,
    flat_results,
    require_lm_eval,
    split_tasks,
)
from lmforge.train.callbacks.registry import register_callback


@register_callback("DownstreamEvalCallback")
class DownstreamEvalCallback(TrainerCallback):
    order = 30  # adds to the step's metrics: before TensorBoard (40), trackers (85), metrics.jsonl (90)

    def __init__(
        self,
        tasks: str | list[str],
        interval: int = 1000,
        limit: int | None = None,
        num_fewshot: int | None = None,
        include_path: str = "",
        tokenizer: str = "",
        batch_size: int = 8,
    ) -> None:
        require_lm_eval("callbacks: DownstreamEvalCallback")
        self.tasks = split_tasks(tasks)
        for key, value in (("interval", interval), ("limit", limit), ("batch_size", batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"DownstreamEvalCallback.{key} must be a positive integer, got {value!r}.")
        for task in self.tasks:
            if task.endswith(".jsonl"):
                _check_jsonl_task(Path(task))  # a broken task file stops the run before it starts
        self.interval, self.limit, self.num_fewshot = interval, limit, num_fewshot
        self.include_path, self.tokenizer_path, self.batch_size = include_path or None, tokenizer, batch_size
        self.tokenizer: Any = None
        self.eot_id = 0
        self.history: list[tuple[int, dict[str, float]]] = []

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        from lmforge.utils.tokenizer import find_eod_id, load_tokenizer

        parallelism = getattr(args, "parallelism", None)
        if int(getattr(parallelism, "pipeline_parallel", 1) or 1) > 1:
            raise ConfigError(
                "DownstreamEvalCallback does not work with parallelism.pipeline_parallel > 1 (the harness "
                "needs whole-model forward passes); run lmforge eval --tasks on a checkpoint instead."
            )
        path = self.tokenizer_path
        if not path and args is not None:
            from lmforge.train.builder import find_tokenizer

            found = find_tokenizer(args)
            path = str(found) if found else ""
        if not path:
            raise DataError(
                "DownstreamEvalCallback: no tokenizer found for the run's data; give its tokenizer: key "
                "(a tokenizer.json or a directory holding one)."
            )
        self.tokenizer = load_tokenizer(path)
        self.eot_id = find_eod_id(self.tokenizer, path)

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if step == 0 or step % self.interval != 0:
            return
        model = kwargs.get("model")
        if isinstance(model, (list, tuple)):
            raise ConfigError("DownstreamEvalCallback needs a single model (no pipeline stages).")
        config = getattr(model, "config", None)
        max_length = getattr(config, "seq_length", None) or getattr(config, "max_position_embeddings", 2048)
        results = evaluate_tasks(
            model,
            self.tokenizer,
            self.tasks,
            eot_id=self.eot_id,
            max_length=int(max_length),
            limit=self.limit,
            num_fewshot=self.num_fewshot,
            include_path=self.include_path,
            batch_size=self.batch_size,
        )
        flat = flat_results(results)
        self.history.append((step, flat))
        metrics = kwargs.get("metrics")
        if isinstance(metrics, dict):
            metrics.update(flat)
        trainer = kwargs.get("trainer")
        if trainer is None or trainer.ctx.rank == 0:
            out_dir = (
                Path(getattr(trainer, "output_dir", None) or getattr(args, "output_dir", ".")) / "lm_eval"
            )
            out_dir.mkdir(parents=True, exist_ok=True)
            record = {"step": step, "tasks": self.tasks, "results": results}
            (out_dir / f"step_{step:08d}.json").write_text(json.dumps(record, indent=2) + "\n")
            logger.info("step %d downstream: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in flat.items()))
