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


_TORCHAO_NOISE = ("Failed to load", "register_constant() on Enum subclasses is deprecated")


@pytest.mark.slow
def test_importing_peft_after_lmforge_prints_no_torchao_library_noise():
    import os
    import subprocess
    import sys

    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", "import lmforge, peft, torchao.float8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [line for line in proc.stderr.splitlines() if any(n in line for n in _TORCHAO_NOISE)], (
        proc.stderr
    )


def test_only_torchaos_cuda_kernel_failures_on_a_cpu_torch_are_dropped(caplog, monkeypatch):
    import logging

    import torch

    import lmforge  # noqa: F401  (installs the filters)

    torchao_log = logging.getLogger("torchao")
    kernel = "Failed to load /venv/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this library"
    with caplog.at_level(logging.WARNING):
        monkeypatch.setattr(torch.version, "cuda", None)
        torchao_log.warning(kernel)  # CPU torch: the CUDA kernel can never load
        torchao_log.warning("Skipping import of cpp extensions due to incompatible torch version.")
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        torchao_log.warning(kernel)  # a CUDA torch that cannot load it: a real problem, shown
        # torch's pytree deprecation: dropped only when torchao's code registers the enum
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'Mine'> is an Enum subclass ... Calling register_constant() on Enum subclasses is deprecated"
        )
    shown = [r.getMessage() for r in caplog.records]
    assert shown[0].startswith("Skipping import") and shown[1] == kernel and "Mine" in shown[2]
    assert len(shown) == 3
