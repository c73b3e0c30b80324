"""``lmforge plan``: layouts that fit, ranked by the step-time model, with the same memory code as check."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from lmforge.cli import main
from lmforge.config import load_config, validate_section
from lmforge.models import build_model, build_model_config
from lmforge.parallel import ParallelDims
from lmforge.tools.memory import estimate_memory
from lmforge.tools.planner import Hardware, Layout, communication_volume, model_facts, plan

RECIPE = "configs/muon_deepseek_v3.yaml"


@pytest.fixture(scope="module")
def recipe():
    return load_config(RECIPE, ["training.global_batch_size=256"])


def test_plan_cli_prints_ranked_layouts_and_valid_yaml_blocks(capsys):
    argv = [
        "plan",
        "--config",
        RECIPE,
        "--gpus",
        "8",
        "--gpu-memory",
        "80GiB",
        "--set",
        "training.global_batch_size=256",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layout(s) fit; fastest first" in out
    times = [float(m) for m in re.findall(r"GiB\s+([0-9.e+-]+)\s", out)]
    assert times == sorted(times) and len(times) >= 3
    block = out.split("# layout 1:", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    parsed = yaml.safe_load(block)
    assert set(parsed) == {"parallelism", "recompute", "training"}
    sets = [f"parallelism.{k}={v}" for k, v in parsed["parallelism"].items()]
    cfg = load_config(RECIPE, [*sets, f"training.local_batch_size={parsed['training']['local_batch_size']}"])
    assert ParallelDims.from_section(cfg.parallelism, 8).world_size == 8


def test_plan_memory_is_checks_estimate(recipe):
    hw = Hardware(gpus=8, gpu_memory=80 * 2**30, nodes=1)
    fits, _, _ = plan(recipe, hw)
    best = next(p for p in fits if p.layout.ep == 1 and p.layout.dp_replicate == 1)
    lay = best.layout
    mc = build_model_config(recipe.model)
    net = build_model(recipe.model, device="meta")
    section = {
        "data_parallel_shard": -1,
        "tensor_parallel": lay.tp,
        "pipeline_parallel": lay.pp,
        "context_parallel": lay.cp,
    }
    est = estimate_memory(
        net,
        ParallelDims.from_section(validate_section("parallelism", section), 8),
        compute_dtype=torch.bfloat16,
        optimizer_type="Muon",
        seq_length=mc.seq_length,
        local_batch_size=lay.local_batch_size,
        hidden_size=mc.hidden_size,
        num_layers=mc.num_layers,
        vocab_size=mc.vocab_size,
        accumulation_steps=256 // (lay.dp * lay.local_batch_size),
    )
    assert best.memory == est.total(recompute=lay.recompute == "full")


def test_communication_volume_formulas(recipe):
    facts, _ = model_facts(recipe)
    c = facts.compute_bytes
    fsdp8 = communication_volume(Layout(dp_shard=8), facts, global_batch_size=256, world=8)
    assert set(fsdp8) == {"fsdp"}
    assert fsdp8["fsdp"] == pytest.approx(facts.total_params * (2 * c + 4) * 7 / 8)
    with_ep = communication_volume(Layout(dp_shard=8, ep=8), facts, global_batch_size=256, world=8)
    assert with_ep["fsdp"] < fsdp8["fsdp"] and with_ep["ep"] > 0  # experts are not gathered across ep
    tp2 = communication_volume(Layout(tp=2, dp_shard=4), facts, global_batch_size=256, world=8)
    tp4 = communication_volume(Layout(tp=4, dp_shard=2), facts, global_batch_size=256, world=8)
    assert 0 < tp2["tp"] < tp4["tp"]


def test_nothing_fits_and_bad_memory(capsys):
    argv = ["plan", "--config", RECIPE, "--gpus", "8", "--gpu-memory", "1GiB"]
    assert main(argv) == 0
    assert "no layout fits 1.00 GiB per GPU" in capsys.readouterr().out
    assert main(["plan", "--config", RECIPE, "--gpus", "8", "--gpu-memory", "lots"]) == 2
    assert "expected a size such as 80GiB" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--efficiency", "0"], "--efficiency 0: expected a number in (0, 1]"),
        (["--efficiency", "5"], "--efficiency 5: expected a number in (0, 1]"),
        (["--gpu-tflops", "0"], "--gpu-tflops 0: expected a number > 0"),
        (["--gpu-tflops", "nan"], "--gpu-tflops nan: expected a number > 0"),
        (["--intra-node-gbps", "0"], "--intra-node-gbps 0: expected a number > 0"),
        (["--inter-node-gbps", "-25"], "--inter-node-gbps -25: expected a number > 0"),
        (["--latency-us", "-5"], "--latency-us -5: expected a number >= 0"),
        (["--top", "0"], "--top 0: expected the number of layouts to list"),
        (["--nodes", "0"], "--nodes must be a positive integer"),
    ],
)
def test_bad_hardware_flags_are_refused_by_name(capsys, flags, needle):
    # Before: 0 rates were a ZeroDivisionError traceback from the step-time model, negative or NaN ones
    # ranked the layouts by nonsense (negative step times), --nodes 0 silently became --gpus / 8.
    argv = ["plan", "--config", RECIPE, "--gpus", "8", "--gpu-memory", "80GiB", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_no_valid_layout_at_all_is_an_error_not_an_empty_table(capsys):
    # 7 GPUs: no tp divides the heads and no dp divides the global batch, so there is no layout to list;
    # it used to print "no layout fits 80.00 GiB per GPU" (memory was not the reason) and an empty table.
    argv = ["plan", "--config", RECIPE, "--gpus", "7", "--gpu-memory", "80GiB"]
    assert main([*argv, "--set", "training.global_batch_size=256"]) == 2
    out, err = capsys.readouterr()
    assert "no layout fits" not in out
    assert "no parallel layout of --gpus 7" in err and "training.global_batch_size 256" in err, err
