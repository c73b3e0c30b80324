"""Downstream evaluation through lm-evaluation-harness with lmforge's model as the harness model.

Reference: the harness's own Hugging Face model (HFLM) on the same weights exported with
`lmforge convert --to-hf`: log-likelihoods, rolling log-likelihoods, greedy generations and task
metrics must agree."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.errors import ConfigError, DataError
from lmforge.models import build_model, save_hf_pretrained

lm_eval = pytest.importorskip("lm_eval")

ITEMS = [
    {"context": "In the beginning God created", "choices": ["the heaven", "a cat", "numbers"], "answer": 0},
    {"context": "Hello", "choices": ["world", "earth", "void"], "answer": 0},
    {"context": "And the earth was", "choices": ["without form", "12345"], "answer": 1},
    {"context": "Numbers", "choices": [" 12345", " and symbols", " naïve"], "answer": 2},
]


@pytest.fixture
def setup(tmp_path, tokenizer_dir, tiny_section):
    """A tiny llama (lmforge), its HF export with the tokenizer, and the task file."""
    torch.manual_seed(0)
    model = build_model(validate_section("model", tiny_section("llama", seq_length=64)))
    hf = tmp_path / "hf"
    save_hf_pretrained(model, hf, tokenizer=tokenizer_dir)
    task = tmp_path / "tiny.jsonl"
    task.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    return model, hf, task


def _instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_adapter_agrees_with_the_harness_hf_model(setup, tokenizer_dir, sample_text):
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer

    from lmforge.train.callbacks.lm_eval_harness import LmforgeLM

    model, hf, _ = setup
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ours = LmforgeLM(model, tok, eot_id=tok.token_to_id("<|endoftext|>"), max_length=64, batch_size=3)
    theirs = HFLM(pretrained=str(hf), device="cpu", dtype="float32", batch_size=1, max_length=64)
    pairs = [(i["context"], " " + c) for i in ITEMS for c in i["choices"]]
    a = ours.loglikelihood(_instances("loglikelihood", pairs))
    b = theirs.loglikelihood(_instances("loglikelihood", pairs))
    assert [g for _, g in a] == [g for _, g in b]
    assert max(abs(x - y) for (x, _), (y, _) in zip(a, b)) <= 1e-4
    long_text = [" ".join(sample_text * 3)]  # longer than max_length: several rolling windows
    ra = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in long_text]))
    rb = theirs.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in long_text]))
    assert abs(ra[0] - rb[0]) <= 1e-3 * abs(rb[0])
    gen = [(t, {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}) for t in ("Hello", "In the")]
    assert ours.generate_until(_instances("generate_until", gen)) == theirs.generate_until(
        _instances("generate_until", gen)
    )


def test_cli_eval_tasks_on_hf_dir_and_lmforge_checkpoint_agree(setup, tmp_path, capsys):
    _, hf, task = setup
    assert main(["eval", "--checkpoint", str(hf), "--tasks", str(task), "--json"]) == 0
    from_hf = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((hf / "lm_eval_results.json").read_text())
    assert saved["results"] == from_hf["results"]
    acc = from_hf["results"]["lmforge_tiny"]
    assert set(acc) == {"acc,none", "acc_norm,none"} and 0 <= acc["acc,none"] <= 1
    # the same weights as an lmforge checkpoint (DCP, tokenizer kept by --from-hf)
    assert main(["convert", "--from-hf", str(hf), "--to", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    out = tmp_path / "res.json"
    assert (
        main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", str(task), "--output", str(out)])
        == 0
    )
    assert "lmforge_tiny: acc " in capsys.readouterr().out
    assert json.loads(out.read_text())["results"] == from_hf["results"]


def test_accuracy_is_the_argmax_of_the_choice_loglikelihoods(setup, tokenizer_dir):
    """acc recomputed by hand from lmforge's own forward pass (the harness's scoring rule)."""
    from tokenizers import Tokenizer

    from lmforge.train.callbacks.lm_eval_harness import evaluate_tasks

    model, _, task = setup
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    got = evaluate_tasks(model, tok, [str(task)], eot_id=0, max_length=64)["lmforge_tiny"]

    def score(ctx, cont):
        whole = tok.encode(ctx + cont, add_special_tokens=False).ids
        n_ctx = len(tok.encode(ctx, add_special_tokens=False).ids)
        with torch.no_grad():
            lp = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)
        return float(sum(lp[i - 1, whole[i]] for i in range(n_ctx, len(whole))))

    hits = hits_norm = 0
    for item in ITEMS:
        scores = [score(item["context"], " " + c) for c in item["choices"]]
        hits += max(range(len(scores)), key=scores.__getitem__) == item["answer"]
        norm = [s / len(c) for s, c in zip(scores, item["choices"])]  # characters, no delimiter
        hits_norm += max(range(len(norm)), key=norm.__getitem__) == item["answer"]
    assert got["acc,none"] == hits / len(ITEMS) and got["acc_norm,none"] == hits_norm / len(ITEMS)


def test_callback_adds_results_to_the_step_metrics(setup, tmp_path, tokenizer_dir):
    from types import SimpleNamespace

    from lmforge.train.callbacks.downstream import DownstreamEvalCallback

    model, _, task = setup
    cb = DownstreamEvalCallback(tasks=str(task), interval=2, tokenizer=str(tokenizer_dir))
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), parallelism=SimpleNamespace(pipeline_parallel=1))
    cb.on_train_begin(args, SimpleNamespace(global_step=0))
    seen = {}
    for step in (1, 2):
        metrics = {"step": step, "loss": 1.0}
        cb.on_step_end(args, SimpleNamespace(global_step=step), model=model, metrics=metrics)
        seen[step] = metrics
    assert seen[1] == {"step": 1, "loss": 1.0}
    assert set(seen[2]) == {"step", "loss", "lm_eval/lmforge_tiny/acc", "lm_eval/lmforge_tiny/acc_norm"}
    record = json.loads((tmp_path / "run" / "lm_eval" / "step_00000002.json").read_text())
    assert record["results"]["lmforge_tiny"]["acc,none"] == seen[2]["lm_eval/lmforge_tiny/acc"]


def test_bad_task_file_and_unknown_task_are_clear_errors(tmp_path, setup):
    from lmforge.train.callbacks.downstream import DownstreamEvalCallback

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"context": "a", "choices": ["x", "y"], "answer": 0}\n{"context": "a", "choices": ["x"], "answer": 0}\n'
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2: a task item is"):
        DownstreamEvalCallback(tasks=str(bad))
    with pytest.raises(ConfigError, match="interval must be a positive integer"):
        DownstreamEvalCallback(tasks=str(setup[2]), interval=0)
    _, hf, _ = setup
    assert main(["eval", "--checkpoint", str(hf), "--tasks", str(bad)]) == 2


def test_missing_harness_names_the_extra(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "lm_eval" else real(n, *a))
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "x.jsonl"]) == 2
    assert "pip install 'lmforge[eval]'" in capsys.readouterr().err


def test_cli_results_go_to_the_run_trackers(
    setup, tmp_path, base_config, tiny_section, wandb_records, monkeypatch
):
    pytest.importorskip("wandb")
    import yaml

    monkeypatch.setenv("WANDB_SILENT", "true")
    _, hf, task = setup
    cfg = dict(base_config, model=tiny_section("llama", seq_length=64), output_dir=str(tmp_path / "run"))
    cfg["train_dataset"]["dataloader"]["config"]["seq_length"] = 64  # the data's length is the model's
    cfg["monitor"] = {"wandb": {"enable": True, "offline": True, "project": "tests"}}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    args = ["eval", "--checkpoint", str(hf), "--config", str(tmp_path / "train.yaml"), "--tasks", str(task)]
    assert main([*args, "--json"]) == 0
    [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in wandb_records(run_file)
        if r.WhichOneof("record_type") == "history"
    ]
    saved = json.loads((hf / "lm_eval_results.json").read_text())["results"]["lmforge_tiny"]
    assert history[0]["lm_eval/lmforge_tiny/acc"] == saved["acc,none"] and history[0]["_step"] == 0


def test_shipped_example_task_runs(setup, tokenizer_dir):
    """configs/tasks/kjv_cloze.jsonl (the documented offline task) is valid and runs."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from lmforge.train.callbacks.lm_eval_harness import _check_jsonl_task, evaluate_tasks

    task = Path(__file__).resolve().parents[3] / "configs" / "tasks" / "kjv_cloze.jsonl"
    assert _check_jsonl_task(task) == 16
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    got = evaluate_tasks(setup[0], tok, [str(task)], eot_id=0, max_length=64, limit=4)
    assert set(got["lmforge_kjv_cloze"]) == {"acc,none", "acc_norm,none"}


def test_evaluation_leaves_the_random_state_alone(setup, tokenizer_dir):
    """The harness seeds random/numpy/torch; a run evaluated every N steps must not see that."""
    import random

    import numpy as np
    from tokenizers import Tokenizer

    from lmforge.train.callbacks.lm_eval_harness import evaluate_tasks

    model, _, task = setup
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    evaluate_tasks(model, tok, [str(task)], eot_id=0, max_length=64)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]


@pytest.mark.slow
def test_unknown_task_name_is_named(setup, tokenizer_dir):
    """Slow (~30 s): a task name makes the harness index its thousands of built-in task files."""
    from tokenizers import Tokenizer

    from lmforge.train.callbacks.lm_eval_harness import evaluate_tasks

    model, _, task = setup
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"unknown task\(s\) no_such_task_xyz"):
        evaluate_tasks(model, tok, [str(task), "no_such_task_xyz"], eot_id=0, max_length=64)
