"""Pipeline parallel with multi-token prediction (DeepSeek-V3's layout) matches one process.

The MTP layers live on the last stage, which looks the shifted tokens up in the embedding carried from
the first stage (``parallel/pp_tied.py``). Two ranks train a tiny DeepSeek-V3 (MLA, MoE with a
balancing loss, MTP) for a few AdamW steps from the same initialisation as a plain single-process loop
written here (torch's AdamW, global-norm clipping, the token-mean loss, auxiliary losses averaged over
micro-batches): the loss, the gradient norm and the logged ``mtp_k_loss`` of every step, every
parameter after the last step, and the loss of a forward-only evaluation of two micro-batches after
training must agree (the second evaluation sends the embedding while FSDP2 has left the first stage's
root unsharded: its parameter is then a plain tensor, which failed in ``lmforge train`` with evaluation).

Tolerance: fp32 end to end; the layouts change only summation orders (the first step's gradients agree
to ~6e-7 relative per tensor, measured), so 1e-5 relative on the losses and 1e-4 on the gradient norm.
The parameters are compared through their updates (final minus initial weights), per tensor: 1e-3
relative in norm, and 1e-4 absolute per element (a thirtieth of one step's lr of 3e-3). Adam divides
each gradient by its own magnitude, so an element whose gradient is near ``eps`` turns that 1e-6
relative noise into up to ~5e-5 absolute (measured on the expert weights); a lost or doubled MTP
gradient, a wrong MTP weight or a missing embedding gradient from the last stage moves the MTP loss of
step 2 and the touched parameters by ~1e-3 (a third of a step).
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import validate_section

from .harness import (
    INIT_SEED,
    MAX_NORM,
    _clip,
    make_data,
    make_optimizer,
    micro_batches,
    run_workers,
    tiny_deepseek,
)

STEPS, GBS, SEQ = 3, 4, 16
LOSS_TOL, NORM_TOL, UPDATE_RTOL, PARAM_ATOL = 1e-5, 1e-4, 1e-3, 1e-4


def _model(**overrides) -> dict:
    # Four layers (one dense, three MoE, and the MTP depths MoE too) so that interleaved 1F1B holds two
    # one-layer stages per rank; a balancing loss so that the MTP layer's MoE gradient is compared too.
    return tiny_deepseek(
        **{"num_hidden_layers": 4, "num_nextn_predict_layers": 1, "aux_loss_alpha": 0.01, **overrides}
    )


def _reference(section: dict, state: dict, data: dict) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Single process, whole global batch: per step loss, gradient norm and MTP losses; final weights."""
    from lmforge.models import build_model

    model = build_model(validate_section("model", section))
    model.load_state_dict(state)
    opt = make_optimizer(model, None)
    steps = []
    for s in range(STEPS):
        mbs = micro_batches(data, s, list(range(GBS)), 1)
        n = sum(float(((b["labels"] >= 0) & (b["loss_mask"] != 0)).sum()) for b in mbs)
        total, mtp = 0.0, {}
        for b in mbs:
            out = model(**b)
            aux = out.loss - out.loss_sum / out.num_tokens.clamp(min=1)  # MTP + balancing, weighted
            (out.loss_sum / n + aux / len(mbs)).backward()
            total += float(out.loss_sum.detach())
            for name, value in out.aux_losses.items():
                mtp[name] = mtp.get(name, 0.0) + float(value.detach()) / len(mbs)
        norm = _clip(model, MAX_NORM)
        opt.step()
        model.update_expert_bias()
        opt.zero_grad()
        steps.append({"loss": total / n, "grad_norm": norm, "aux": mtp})
    evals = []
    with torch.no_grad():  # the trained model's LM loss on the first step's first two micro-batches
        for b in micro_batches(data, 0, list(range(GBS)), 1)[:2]:
            out = model(**b)
            evals.append(float(out.loss_sum / out.num_tokens))
    return {"steps": steps, "eval": evals}, {k: v.detach().clone() for k, v in model.named_parameters()}


def _compare_parameters(name: str, got: dict, ref: dict, start: dict, worst: dict) -> list[str]:
    failures = []
    for key, value in got.items():
        diff = (value - ref[key]).abs()
        update = float((ref[key] - start[key]).norm())
        rel = float(diff.norm()) / max(update, 1e-30)
        worst["param"] = max(worst["param"], float(diff.max()))
        worst["update"] = max(worst["update"], rel)
        if float(diff.max()) > PARAM_ATOL or rel > UPDATE_RTOL:
            failures.append(
                f"{name} parameter {key}: max |diff| {float(diff.max()):.2e}, update differs by {rel:.2e} "
                f"of its norm after {STEPS} steps"
            )
    return failures


CASES = {
    "pp_1f1b": ({}, {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"}),
    "pp_interleaved": (
        {},
        {
            "pipeline_parallel": 2,
            "pipeline_parallel_schedule": "interleaved_1f1b",
            "pipeline_parallel_interleave_num": 2,
        },
    ),
    # Tied embeddings: one carried weight is the output layer and the MTP lookup table; two MTP depths.
    "pp_gpipe_tied_depth2": (
        {"tie_word_embeddings": True, "num_nextn_predict_layers": 2},
        {"pipeline_parallel": 2, "pipeline_parallel_schedule": "gpipe"},
    ),
    # Recompute on the last stage: its last decoder layer and the MTP layer (id num_layers + 0) whole.
    "pp_1f1b_recompute": (
        {},
        {"pipeline_parallel": 2},
        {
            "recompute": {
                "mode": "select",
                "full_recompute_layer": ["3", "4"],
                "select_module": {"mlp": ["1"]},
            }
        },
    ),
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_pipeline_with_mtp_matches_single_process(tmp_path):
    _check_cases(CASES, 2, tmp_path)


def _check_cases(cases: dict, world: int, tmp_path) -> None:
    from lmforge.models import build_model

    specs, refs = [], {}
    for name, (overrides, parallelism, *activation) in cases.items():
        section = _model(**overrides)
        torch.manual_seed(0)
        model = build_model(validate_section("model", section), seed=INIT_SEED)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        data = make_data(STEPS, GBS, SEQ, section["vocab_size"], seed=7)
        refs[name] = _reference(section, state, data)
        torch.save(state, tmp_path / f"{name}_state.pt")
        torch.save(data, tmp_path / f"{name}_data.pt")
        specs.append(
            {
                "name": name,
                "model": section,
                "parallelism": parallelism,
                "activation": activation[0] if activation else None,
                "state": str(tmp_path / f"{name}_state.pt"),
                "data": str(tmp_path / f"{name}_data.pt"),
            }
        )
    results = run_workers(
        world,
        {
            "task": "trained_parameters_task",
            "cases": specs,
            "gbs": GBS,
            "lbs": 1,
            "params_dir": str(tmp_path),
        },
        timeout=300,
    )
    failures, worst = [], {"loss": 0.0, "mtp": 0.0, "param": 0.0, "update": 0.0}
    for name, (ref_steps, ref_params) in refs.items():
        depth = _model(**cases[name][0])["num_nextn_predict_layers"]
        for rank, res in enumerate(results):
            for a, b in zip(res[name]["eval"], ref_steps["eval"], strict=True):
                if not math.isclose(a, b, rel_tol=LOSS_TOL):
                    failures.append(f"{name} rank {rank} evaluation: {a} vs single-process {b}")
            for s, (got, ref) in enumerate(zip(res[name]["steps"], ref_steps["steps"], strict=True)):
                assert sorted(got["aux"]) == sorted(ref["aux"]), (name, got["aux"], ref["aux"])
                assert {f"mtp_{k}_loss" for k in range(1, depth + 1)} <= set(got["aux"])
                checks = [("loss", got["loss"], ref["loss"], LOSS_TOL)]
                checks.append(("grad_norm", got["grad_norm"], ref["grad_norm"], NORM_TOL))
                checks += [(k, got["aux"][k], v, LOSS_TOL) for k, v in ref["aux"].items()]
                for key, a, b, tol in checks:
                    if key.startswith("mtp"):
                        worst["mtp"] = max(worst["mtp"], abs(a - b) / abs(b))
                    elif key == "loss":
                        worst["loss"] = max(worst["loss"], abs(a - b) / abs(b))
                    if not math.isclose(a, b, rel_tol=tol, abs_tol=1e-8):
                        failures.append(f"{name} rank {rank} step {s} {key}: {a} vs single-process {b}")
        held = [torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=True) for r in range(world)]
        # Every parameter lives on exactly one pipeline stage (the MTP layers on the last one); pp is the
        # outermost mesh dimension, so the first half of the ranks holds the first stage.
        first, last = held[0], held[-1]
        assert not set(first) & set(last), name
        assert set(first) | set(last) == set(ref_params), name
        assert any(k.startswith("mtp.") for k in last) and not any(k.startswith("mtp.") for k in first)
        start = torch.load(tmp_path / f"{name}_state.pt", weights_only=True)
        for params in held:
            failures += _compare_parameters(name, params, ref_params, start, worst)
    print("largest differences: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert not failures, "\n".join(failures)


# Four ranks: the carried embedding's gradient is summed over data-parallel ranks (PP × FSDP) and over
# the tensor-parallel ranks' sequence slices (PP × TP, the spec's FSDP + TP + PP layout without EP).
FOUR_RANK_CASES = {
    "pp_x_fsdp": ({}, {"pipeline_parallel": 2}),
    "pp_x_tp": ({}, {"pipeline_parallel": 2, "tensor_parallel": 2}),
    # The spec's layout has expert parallel too: the MTP layer's experts are split like the others.
    "pp_x_ep": ({}, {"pipeline_parallel": 2, "expert_parallel": 2}),
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_pipeline_with_mtp_on_four_ranks_matches_single_process(tmp_path):
    _check_cases(FOUR_RANK_CASES, 4, tmp_path)


def test_memory_estimate_puts_the_mtp_layers_on_the_last_stage():
    """``lmforge check``'s estimate: under pp the MTP parameters are counted whole (they all live on the
    last stage, not 1/pp of them), and each MTP depth adds more than a decoder layer's activations."""
    from lmforge.config import ParallelismConfig
    from lmforge.models import build_model
    from lmforge.parallel import ParallelDims
    from lmforge.tools.memory import estimate_memory

    def estimate(depth: int, pp: int, num_layers: int = 4):
        model = build_model(validate_section("model", _model(num_nextn_predict_layers=depth)), device="meta")
        dims = ParallelDims.from_section(ParallelismConfig(pipeline_parallel=pp), pp)
        est = estimate_memory(
            model,
            dims,
            compute_dtype=torch.float32,
            optimizer_type="AdamW",
            seq_length=SEQ,
            local_batch_size=1,
            hidden_size=32,
            num_layers=num_layers,
            vocab_size=64,
        )
        return est, sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))

    # One decoder layer's activations: the estimate with one layer fewer on one stage.
    per_layer = estimate(0, 1)[0].activations - estimate(0, 1, num_layers=3)[0].activations
    assert per_layer > 0
    for pp in (1, 2):
        without, _ = estimate(0, pp)
        with_mtp, mtp_params = estimate(2, pp)
        assert with_mtp.local_parameter_count - without.local_parameter_count == mtp_params
        assert with_mtp.activations - without.activations > 2 * per_layer


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_with_mtp_resumes_bit_for_bit(tmp_path):
    """A 2-rank interleaved-1F1B run with MTP and tied embeddings saves after step 2; a second run resumes
    from that checkpoint and repeats steps 2 and 3 exactly (the MTP layers' weights, optimizer moments and
    expert bias live only on the last stage's rank and must come back there); both match one process."""
    from lmforge.models import build_model

    from .harness import reference_run

    steps, save_at = 4, 2
    adamw = {"type": "AdamW", "weight_decay": 0.01}
    section = _model(tie_word_embeddings=True)
    torch.manual_seed(0)
    state = {
        k: v.detach().clone()
        for k, v in build_model(validate_section("model", section), seed=INIT_SEED).state_dict().items()
    }
    data = make_data(steps, GBS, SEQ, section["vocab_size"], seed=3)
    ref = reference_run(section, state, data, 1, adamw)["loss"]
    torch.save(state, tmp_path / "state.pt")
    torch.save(data, tmp_path / "data.pt")
    common = {
        "task": "checkpoint_task",
        "model": section,
        "parallelism": CASES["pp_interleaved"][1],
        "optimizer": adamw,
        "state": str(tmp_path / "state.pt"),
        "data": str(tmp_path / "data.pt"),
        "gbs": GBS,
        "lbs": 1,
    }
    saved = run_workers(2, {**common, "save_path": str(tmp_path / "ckpt"), "save_at": save_at}, timeout=140)
    resumed = run_workers(2, {**common, "resume": str(tmp_path / "ckpt")}, timeout=140)
    for rank in range(2):
        whole, cont = saved[rank]["loss"], resumed[rank]["loss"]
        assert sorted(map(int, cont)) == [save_at, save_at + 1]
        for step, loss in cont.items():
            assert loss == whole[step], f"rank {rank} step {step}: resumed {loss!r} vs {whole[step]!r}"
            # The MTP loss of step 3 depends on the MTP weights updated with the restored moments.
            got, want = resumed[rank]["aux_losses"][step], saved[rank]["aux_losses"][step]
            assert got["mtp_1_loss"] == want["mtp_1_loss"], (rank, step, got, want)
        for step, loss in whole.items():
            assert math.isclose(loss, ref[int(step)], rel_tol=LOSS_TOL), (step, loss, ref[int(step)])


@pytest.mark.slow  # two DeepSeek-V3 recipes built on meta (~10 s)
def test_planner_counts_the_carried_embedding_under_pipeline_parallel():
    """``lmforge plan``: with MTP (or tied embeddings) each pipeline step moves the embedding weight to the
    last stage and its gradient back, 2 × vocab × hidden fp32 values beside the activations."""
    from lmforge.config import load_config
    from lmforge.tools.planner import Layout, communication_volume, model_facts

    def pp_bytes(depth: int) -> tuple[float, object]:
        cfg = load_config(
            "configs/muon_deepseek_v3.yaml",
            ["training.global_batch_size=256", f"model.num_nextn_predict_layers={depth}"],
        )
        facts, _ = model_facts(cfg)
        return communication_volume(Layout(pp=2, dp_shard=4), facts, global_batch_size=256, world=8)[
            "pp"
        ], facts

    without, _ = pp_bytes(0)
    with_mtp, facts = pp_bytes(1)
    assert with_mtp - without == pytest.approx(2 * facts.vocab_size * facts.hidden_size * 4)


@pytest.mark.slow  # check on the spec's full-size model (meta device, ~10 s)
def test_check_accepts_the_spec_pp_mtp_layout_and_places_the_mtp_layer(tmp_path, capsys):
    """The spec's FSDP + TP + PP + EP example over its DeepSeek-V3 skeleton (MTP depth 1 by default) at the
    smallest world it fits, 32 ranks: ``check`` accepts it (it refused PP + MTP before) and lists the MTP
    layer with the last stage."""
    from pathlib import Path

    import yaml

    from lmforge.cli import main

    spec = Path(__file__).resolve().parents[1] / "fixtures" / "spec_yamls"
    merged = {
        **yaml.safe_load((spec / "004_skeleton.yaml").read_text(encoding="utf-8")),
        **yaml.safe_load((spec / "004_parallelism.yaml").read_text(encoding="utf-8")),
    }
    path = tmp_path / "frag_parallel_world32.yaml"
    path.write_text(yaml.safe_dump(merged), encoding="utf-8")
    assert main(["check", "--config", str(path), "--world-size", "32"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "pipeline stage 1 (pp rank 1): layers 6-11, MTP layer 12" in out
