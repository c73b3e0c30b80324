"""Downstream evaluation through lm-evaluation-harness, with lmforge's own model as the harness model.

``evaluate_tasks(model, tokenizer, tasks, ...)`` runs harness tasks on a model in memory (no export):
``LmforgeLM`` scores log-likelihoods with the model's forward pass and generates greedily. A task is a
harness task name (from its registry or ``include_path``) or a local JSONL file of multiple-choice
items, one per line: ``{"context": "...", "choices": ["...", "..."], "answer": 1}``, scored like the
harness's multiple-choice tasks (``acc``: the choice with the highest log-likelihood;
``acc_norm``: the same divided by the choice's length in characters). The package is the optional extra ``[eval]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.errors import ConfigError, DataError


def require_lm_eval(what: str = "downstream evaluation (--tasks)") -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{what} runs lm-evaluation-harness, which is not installed; install it with "
            "pip install 'lmforge[eval]'."
        )


def _check_jsonl_task(path: Path) -> int:
    """Validate a local task file before the harness reads it; the number of items."""
    if not path.is_file():
        raise DataError(f"task file {path} does not exist.")
    count = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno} is not valid JSON: {exc}") from None
            choices = item.get("choices") if isinstance(item, dict) else None
            ok = (
                isinstance(item, dict)
                and isinstance(item.get("context"), str)
                and isinstance(choices, list)
                and len(choices) >= 2
                and all(isinstance(c, str) for c in choices)
                and isinstance(item.get("answer"), int)
                and not isinstance(item.get("answer"), bool)
                and 0 <= item["answer"] < len(choices)
            )
            if not ok:
                raise DataError(
                    f'{path}:{lineno}: a task item is {{"context": str, "choices": [str, str, ...], '
                    f'"answer": index into choices}}, got {line.strip()[:200]}'
                )
            count += 1
    if count == 0:
        raise DataError(f"task file {path} holds no items.")
    return count


def _jsonl_task_yaml(name: str, path: Path) -> str:
    # A plain harness task over the "json" dataset builder (offline: a local file, no Hub access).
    return "\n".join(
        [
            f"task: {json.dumps(name)}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(path.resolve()))}",
            "test_split: test",
            "output_type: multiple_choice",
            'doc_to_text: "{{context}}"',
            'doc_to_choice: "{{choices}}"',
            'doc_to_target: "{{answer}}"',
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "  - metric: acc_norm",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


def split_tasks(tasks: str | list[str]) -> list[str]:
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    items = [t.strip() for t in items if t and t.strip()]
    if not items:
        raise ConfigError("--tasks needs at least one task: a harness task name or a .jsonl file.")
    return items


def evaluate_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: str | list[str],
    *,
    eot_id: int,
    max_length: int,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | None = None,
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """Run ``tasks``; ``{task: {metric: value}}`` (the harness's ``metric,filter`` keys, numbers only)."""
    require_lm_eval()
    only_local = all(t.endswith(".jsonl") for t in split_tasks(tasks)) and not include_path
    if only_local:  # local files never need the Hub: no network look-ups (set before datasets is imported)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lmforge-tasks-") as tmp:
        local = False
        for task in split_tasks(tasks):
            if task.endswith(".jsonl"):
                path = Path(task)
                _check_jsonl_task(path)
                name = f"lmforge_{path.stem}"
                (Path(tmp) / f"{name}.yaml").write_text(_jsonl_task_yaml(name, path))
                names.append(name)
                local = True
            else:
                names.append(task)
        include = [tmp] if local else []
        if include_path:
            include.append(include_path)
        manager = TaskManager(include_path=include or None, include_defaults=not only_local)
        unknown = [n for n in names if n not in manager.all_tasks]
        if unknown:
            raise ConfigError(
                f"--tasks: unknown task(s) {', '.join(unknown)}; give a harness task name (lm_eval --tasks list), "
                "a task directory with --include-path, or a local .jsonl file (docs/guide.md)."
            )
        lm = LmforgeLM(model, tokenizer, eot_id=eot_id, max_length=max_length, batch_size=batch_size)
        with _preserved_rng(), _no_git_probe():  # the harness seeds random / numpy / torch
            out = simple_evaluate(
                model=lm,
                tasks=names,
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                bootstrap_iters=0,
                log_samples=False,
            )
    results: dict[str, dict[str, float]] = {}
    for task, metrics in (out or {}).get("results", {}).items():
        results[task] = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and "stderr" not in k
            and k != "sample_len"
        }
    return results


@contextlib.contextmanager
def _no_git_probe():
    """The harness records ``git describe`` of the working directory in its results; outside a git
    repository git prints "fatal: not a git repository" on the user's terminal. That commit is not
    the model's provenance anyway (lmforge records the checkpoint), so it is not asked for."""
    from unittest import mock

    import lm_eval.evaluator

    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
        yield


@contextlib.contextmanager
def _preserved_rng():
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def flat_results(results: dict[str, dict[str, float]], prefix: str = "lm_eval") -> dict[str, float]:
    """``{"lm_eval/<task>/<metric>": value}`` (the harness's ``,none`` filter suffix dropped)."""
    return {
        f"{prefix}/{task}/{key.removesuffix(',none')}": value
        for task, metrics in results.items()
        for key, value in metrics.items()
    }


def _within_vocab(encoding: Any, lm: Any) -> list[int]:
    """The ids of ``encoding`` when the model has an embedding for each; a tokenizer of another model (ids
    past model.vocab_size) is refused here: the lookup was an IndexError traceback from inside the model."""
    ids = encoding.ids
    vocab = getattr(getattr(lm.model, "config", None), "vocab_size", None)
    if vocab is not None and ids and max(ids) >= vocab:
        raise DataError(
            f"the tokenizer encodes task text to token id {max(ids)}, but the model has {vocab} token ids "
            "(model.vocab_size): it is not this model's tokenizer. Give the model's own tokenizer (--tokenizer PATH)."
        )
    return list(ids)


def _lm_class() -> type:
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class _LmforgeLM(TemplateLM):
        """lm-evaluation-harness's model interface over an lmforge model and a ``tokenizers.Tokenizer``."""

        def __init__(
            self, model: nn.Module, tokenizer: Any, eot_id: int, max_length: int, batch_size: int = 8
        ):
            super().__init__()
            self.model, self._tok, self._eot = model, tokenizer, int(eot_id)
            self.max_length, self.batch_size = int(max_length), max(1, int(batch_size))
            self._device = next(model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return self._eot

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return _within_vocab(self._tok.encode(string, add_special_tokens=bool(add_special_tokens)), self)

        def tok_decode(self, ids: list[int], **kwargs: Any) -> str:
            return self._tok.decode(list(ids))

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any):
            was_training = self.model.training
            self.model.eval()
            out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
            # Longest first, as the harness's HF model does: batches of similar lengths pad little.
            order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
            try:
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    rows, conts = [], []
                    for i in chunk:
                        _, ctx, cont = requests[i]
                        whole = (list(ctx) + list(cont))[-(self.max_length + 1) :]
                        rows.append(whole[:-1])
                        conts.append(list(cont))
                    width = max(len(r) for r in rows)
                    # Right padding: the model is causal, so a row's real positions never see it.
                    ids = torch.full((len(rows), width), self._eot, dtype=torch.long)
                    for j, r in enumerate(rows):
                        ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
                    logits = self.model(ids.to(self._device)).logits
                    for j, (i, r, cont) in enumerate(zip(chunk, rows, conts)):
                        n = len(cont)
                        # only the continuation's positions need the (vocabulary-wide) log-softmax
                        lp = logits[j, len(r) - n : len(r)].float().log_softmax(-1).cpu()
                        target = torch.tensor(cont, dtype=torch.long)
                        total = float(lp.gather(-1, target[:, None]).sum())
                        out[i] = (total, bool((lp.argmax(-1) == target).all()))
            finally:
                self.model.train(was_training)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            results = []
            for (string,) in [req.args for req in requests]:
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self._eot,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
                results.append(sum(lp for lp, _ in scored))
            return results

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            from lmforge.train.generation import sample_tokens

            out = []
            for context, gen_kwargs in [req.args for req in requests]:
                kwargs = dict(gen_kwargs or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
                prompt = self.tok_encode(context) or [self._eot]
                new = sample_tokens(
                    self.model,
                    prompt,
                    max_new_tokens=int(kwargs.get("max_gen_toks", 256)),
                    temperature=temperature,
                    context_length=self.max_length,
                    eos_id=self._eot,
                )
                text = self.tok_decode([t for t in new if t != self._eot])
                for stop in until:
                    if stop and stop in text:
                        text = text[: text.index(stop)]
                out.append(text)
            return out

    return _LmforgeLM


def LmforgeLM(model: nn.Module, tokenizer: Any, **kwargs: Any) -> Any:  # noqa: N802 (a class factory)
    """An lm-evaluation-harness ``TemplateLM`` over ``model`` (built lazily: the harness is optional)."""
    require_lm_eval()
    return _lm_class()(model, tokenizer, **kwargs)
