"""Quiet by default: what a run prints is lmforge's, not third-party noise on every run."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.config import validate_section

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_have_no_dead_name_patterns(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", "--config", str(recipe)]) == 0
    assert "matches no parameter" not in out.getvalue()


def test_building_the_device_mesh_warns_nothing(tmp_path, base_config):
    import torch.distributed as dist

    from lmforge.config import load_config
    from lmforge.parallel.dims import ParallelDims

    dims = ParallelDims.from_section(load_config(base_config).parallelism, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = dims.build_mesh("cpu")
        groups = [mesh.fsdp_mesh(), mesh["dp"], mesh["dp_cp_tp"], mesh["tp"]]
        assert mesh.dp_rank == 0 and all(m.size() == 1 for m in groups)
    assert [str(w.message) for w in caught] == []


def test_downstream_eval_outside_a_git_repository_prints_no_git_error(tmp_path, monkeypatch, capfd):
    pytest.importorskip("lm_eval")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmforge.models import build_model
    from lmforge.train.callbacks.lm_eval_harness import evaluate_tasks

    monkeypatch.chdir(tmp_path)  # not inside any git repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    vocab = {w: i for i, w in enumerate(["<eos>", "a", "b", "c", "d"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    task = tmp_path / "t.jsonl"
    task.write_text('{"context": "a b", "choices": ["c", "d"], "answer": 0}\n')
    torch.manual_seed(0)
    model = build_model(
        validate_section(
            "model",
            {
                "model_type": "llama",
                "architectures": "LlamaForCausalLM",
                "num_hidden_layers": 1,
                "hidden_size": 16,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "vocab_size": 5,
                "seq_length": 16,
                "compute_dtype": "float32",
            },
        )
    )
    evaluate_tasks(model, tok, [str(task)], eot_id=0, max_length=16, limit=1)
    captured = capfd.readouterr()
    assert "not a git repository" not in captured.err + captured.out


def test_bias_exclusion_on_a_model_without_biases_is_quiet_but_a_typo_is_not(tmp_path, base_config):
    import yaml

    base_config["optimizer"] = {"type": "AdamW", "weight_decay_exclude": ["*norm*", "*bias*", "*nrom*"]}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(base_config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", "--config", str(path)]) == 0
    assert "'*nrom*' matches no parameter" in out.getvalue()
    assert "'*bias*' matches no parameter" not in out.getvalue()
