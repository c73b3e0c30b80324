"""Spawned gloo workers and the single-process reference they are compared with.

The reference is a plain loop written here with ``torch.optim.AdamW`` and global-norm clipping
(``max_norm / (norm + 1e-6)``, as ``torch.nn.utils.clip_grad_norm_``) on the unparallelised model: the loss of a step is the token mean
over the whole global batch (each micro-batch backpropagates ``loss_sum / N``), the auxiliary losses
are averaged over micro-batches. The workers run lmforge's ``parallelize`` and the trainer's
``TrainStep`` on their share of the same global batch, starting from the same weights.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.config import validate_section

LR = 3e-3
MAX_NORM = 1.0


def tiny_llama(**overrides: Any) -> dict[str, Any]:
    section = {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": 64,
        "compute_dtype": "float32",
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    }
    section.update(overrides)
    return section


def tiny_qwen3_moe(**overrides: Any) -> dict[str, Any]:
    section = {
        "model_type": "qwen3_moe",
        "architectures": "Qwen3MoeForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 64,
        "compute_dtype": "float32",
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "output_router_logits": True,  # the Switch balancing loss, so its gradient is compared too
        "router_aux_loss_coef": 0.05,
    }
    section.update(overrides)
    return section


def tiny_deepseek(**overrides: Any) -> dict[str, Any]:
    section = {
        "model_type": "deepseek_v3",
        "architectures": "DeepseekV3ForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "vocab_size": 64,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "num_nextn_predict_layers": 0,
        "compute_dtype": "float32",
        "initializer_range": 0.2,
    }
    section.update(overrides)
    return section


def make_data(
    steps: int, gbs: int, seq: int, vocab: int, seed: int = 1, documents: bool = False
) -> dict[str, torch.Tensor]:
    """Random tokens, a random loss mask, and with ``documents`` three packed documents per row
    (``actual_seq_len`` end offsets, the compressed EOD form)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (steps, gbs, seq + 1), generator=g)
    loss_mask = (torch.rand(steps, gbs, seq, generator=g) > 0.2).long()
    data = {
        "input_ids": ids[..., :-1].contiguous(),
        "labels": ids[..., 1:].contiguous(),
        "loss_mask": loss_mask,
    }
    if documents:
        cuts = torch.stack([torch.randperm(seq - 1, generator=g)[:2] + 1 for _ in range(steps * gbs)])
        ends = torch.cat([cuts.sort(dim=1).values, torch.full((steps * gbs, 1), seq)], dim=1)
        data["actual_seq_len"] = ends.view(steps, gbs, 3)
    return data


def micro_batches(
    data: dict[str, torch.Tensor], step: int, rows: list[int], lbs: int
) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(0, len(rows), lbs):
        idx = torch.tensor(rows[i : i + lbs])
        out.append({k: v[step].index_select(0, idx).clone() for k, v in data.items()})
    return out


def make_optimizer(model, optimizer: dict[str, Any] | None):
    """torch's AdamW, or lmforge's ``build_optimizer`` for an ``optimizer`` section (e.g. Muon)."""
    if optimizer is None:
        return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    from lmforge.optim import build_optimizer

    return build_optimizer(validate_section("optimizer", optimizer), model, LR)


def reference_run(
    section: dict[str, Any],
    state: dict[str, torch.Tensor],
    data,
    lbs: int,
    optimizer: dict[str, Any] | None = None,
) -> dict[str, list[float]]:
    """Single process, whole global batch, torch's AdamW (or the given optimizer) and clip_grad_norm_."""
    from lmforge.models import build_model

    model = build_model(validate_section("model", section))
    model.load_state_dict(state)
    opt = make_optimizer(model, optimizer)
    steps, gbs = data["input_ids"].shape[:2]
    losses, norms = [], []
    for s in range(steps):
        mbs = micro_batches(data, s, list(range(gbs)), lbs)
        n = sum(float(((b["labels"] >= 0) & (b["loss_mask"] != 0)).sum()) for b in mbs)
        total = 0.0
        for b in mbs:
            out = model(**b)
            objective = out.loss_sum / n
            if out.aux_losses:
                objective = objective + (out.loss - out.loss_sum / out.num_tokens.clamp(min=1)) / len(mbs)
            objective.backward()
            total += float(out.loss_sum.detach())
        norms.append(_clip(model, MAX_NORM))
        opt.step()
        if hasattr(model, "update_expert_bias"):
            model.update_expert_bias()  # aux-loss-free balancing, once per update (as the trainer's step)
        opt.zero_grad()
        losses.append(total / n)
    return {"loss": losses, "grad_norm": norms}


@torch.no_grad()
def _clip(model, max_norm: float) -> float:
    """Global-norm clipping of the gradients the optimizer uses."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum(g.float().square().sum() for g in grads)))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


INIT_SEED = 1234  # every layout initialises from this seed; the reference model too


def assert_init_matches(model, state: dict[str, torch.Tensor]) -> None:
    """A fresh layout-invariant init on this layout equals the single-process init bit for bit."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            ref = state[name].to(full.dtype)
            if not torch.equal(full, ref):
                raise AssertionError(
                    f"initial {name} differs from the single-process init: max |diff| "
                    f"{(full.float() - ref.float()).abs().max():.3e}"
                )


def _worker(rank: int, world: int, init_file: str, spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import faulthandler

    out_path = Path(spec["out"]) / f"rank{rank}.json"
    stacks = open(Path(spec["out"]) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (kept open until exit)
    faulthandler.dump_traceback_later(spec["timeout"] - 5, exit=True, file=stacks)
    faulthandler.register(15, file=stacks, all_threads=True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = globals()[spec["task"]](rank, world, spec)
        out_path.write_text(json.dumps({"ok": True, **result}))
    except BaseException as exc:  # report to the parent instead of hanging it
        out_path.write_text(json.dumps({"ok": False, "error": f"{exc!r}\n{traceback.format_exc()}"}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_parallel(rank: int, world: int, spec: dict[str, Any]):
    from lmforge.models import build_model
    from lmforge.parallel import ParallelDims, accumulation_steps, parallelize

    par = validate_section("parallelism", spec["parallelism"])
    dims = ParallelDims.from_section(par, world)
    mesh = dims.build_mesh("cpu")
    accum = accumulation_steps(spec["gbs"], spec["lbs"], dims.dp)
    model = build_model(validate_section("model", spec["model"]), device="meta")
    model, info = parallelize(
        model, dims, mesh, par, num_microbatches=accum, apply_activation=_activation(spec, dims, model)
    )
    model.to_empty(device="cpu")
    model.init_weights(INIT_SEED)
    return model, info, accum


def _activation(spec: dict[str, Any], dims: Any, model: Any):
    """Recompute / swap as the trainer applies them (``spec['activation']``: the three YAML sections)."""
    sections = spec.get("activation")
    if not sections:
        return None
    from lmforge.parallel.activation import apply_activation_memory

    return lambda m: apply_activation_memory(
        m,
        validate_section("recompute", sections.get("recompute") or {}),
        validate_section("recompute_comm", sections.get("recompute_comm") or {}),
        validate_section("swap", sections.get("swap") or {}),
        model.config.num_layers,
        pipeline_parallel=dims.pp,
        has_comm_ops=dims.tp * dims.cp * dims.ep > 1,
    )


def train_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train every case of ``spec['cases']`` in turn (one spawn, several layouts)."""
    out: dict[str, Any] = {}
    for case in spec["cases"]:
        out[case["name"]] = _train_case(rank, world, {**spec, **case})
    return out


def _train_case(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    from lmforge.train.parallel_seam import ParallelContext
    from lmforge.train.step import TrainStep

    torch.manual_seed(0)
    model, info, accum = build_parallel(rank, world, spec)
    # No injected weights: the layout's own init must already be the reference's.
    assert_init_matches(model, torch.load(spec["state"], weights_only=True))
    data = torch.load(spec["data"], weights_only=True)
    opt = make_optimizer(model, spec.get("optimizer"))
    ctx = ParallelContext(rank=rank, world_size=world).placed(info)
    scaler = None
    if spec["model"].get("compute_dtype") == "float16":
        from lmforge.train.loss_scale import LossScaler

        scaler = LossScaler()  # as the trainer does for fp16 compute
    step = TrainStep(model, opt, None, max_norm=MAX_NORM, ctx=ctx, loss_scaler=scaler)
    per_rank = spec["gbs"] // info.dp_size
    rows = list(range(info.dp_rank * per_rank, (info.dp_rank + 1) * per_rank))
    losses, norms = [], []
    for s in range(data["input_ids"].shape[0]):
        r = step(micro_batches(data, s, rows, spec["lbs"]))
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return {"loss": losses, "grad_norm": norms}


def buffers_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One training step with max-logit tracking on; this rank's MoE token counts and max logits."""
    from lmforge.train.parallel_seam import ParallelContext
    from lmforge.train.step import TrainStep

    model, info, _ = build_parallel(rank, world, spec)
    model.track_max_logits = True
    ctx = ParallelContext(rank=rank, world_size=world).placed(info)
    step = TrainStep(model, make_optimizer(model, None), None, max_norm=MAX_NORM, ctx=ctx)
    data = torch.load(spec["data"], weights_only=True)
    per_rank = spec["gbs"] // info.dp_size
    result = step(
        micro_batches(
            data, 0, list(range(info.dp_rank * per_rank, (info.dp_rank + 1) * per_rank)), spec["lbs"]
        )
    )
    out: dict[str, Any] = {"aux_losses": result.aux_losses}
    out |= {
        name: buf.tolist()
        for name, buf in model.named_buffers()
        if name.endswith(("tokens_per_expert", "max_logits"))
    }
    # Pipeline parallel runs visible stage modules; nothing is bound to the model's modules.
    modules = [*model.modules(), *(m for s in info.pipeline.stage_modules for m in s.modules())]
    out["bound_methods"] = sorted(
        {f"{type(m).__name__}.{k}" for m in modules for k, v in vars(m).items() if hasattr(v, "__self__")}
    )
    return out


class LargestFloat32(TorchDispatchMode):
    """Records the largest fp32 tensor any operation returns while it is active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def pipeline_loss_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One pipelined forward/backward and one evaluation per ``spec['chunks']`` loss_chunk_size, with the
    same weights and batch: the largest fp32 tensor each produced on this rank, the loss, and the
    relative difference of every gradient from the first setting's (this rank's parameters)."""
    from torch.distributed.tensor import DTensor

    data = torch.load(spec["data"], weights_only=True)
    out: dict[str, Any] = {}
    first_grads: dict[str, torch.Tensor] = {}
    for chunk in spec["chunks"]:
        model, info, _ = build_parallel(
            rank, world, {**spec, "model": {**spec["model"], "loss_chunk_size": chunk}}
        )
        pipe = info.pipeline
        batches = micro_batches(data, 0, list(range(spec["gbs"])), spec["lbs"])
        n = sum(float(((b["labels"] >= 0) & (b["loss_mask"] != 0)).sum()) for b in batches)
        train = LargestFloat32()
        with train:
            args, kwargs = pipe.step_inputs(batches, scale=1.0 / n, aux_scale=0.0)
            pipe.schedule.step(*args, **kwargs)
            loss_sum, tokens, _ = pipe.finish_step()
        evaluation = LargestFloat32()
        with evaluation:
            eval_sum, eval_tokens = pipe.evaluate_batch(batches[0])
        grads = {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        first_grads = first_grads or grads
        rel = {
            name: float((g - first_grads[name]).norm() / first_grads[name].norm().clamp(min=1e-30))
            for name, g in grads.items()
        }
        out[str(chunk)] = {
            "largest_fp32_train": [train.numel, list(train.shape)],
            "largest_fp32_eval": [evaluation.numel, list(evaluation.shape)],
            "loss": float(loss_sum) / float(tokens),
            "tokens": float(tokens),
            "eval_loss": float(eval_sum) / float(eval_tokens),
            "grad_rel_diff": rel,
            "last_stage": pipe.has_last,
        }
    return out


def checkpoint_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train on this layout; save after ``save_at`` steps, or resume from ``resume`` and continue."""
    from lmforge.train.checkpoint import (
        Checkpointable,
        CheckpointManager,
        load_checkpoint,
        resolve_checkpoint,
    )
    from lmforge.train.parallel_seam import ParallelContext
    from lmforge.train.state import TrainState
    from lmforge.train.step import TrainStep

    torch.manual_seed(0)
    if world > 1:
        model, info, _ = build_parallel(rank, world, spec)
        dp_rank, dp_size, dp_group = info.dp_rank, info.dp_size, info.dp_group
        pipeline = info.pipeline
    else:
        from lmforge.models import build_model

        model = build_model(validate_section("model", spec["model"]), seed=INIT_SEED)
        dp_rank, dp_size, dp_group, pipeline = 0, 1, None, None
    opt = make_optimizer(model, spec.get("optimizer"))
    state = TrainState()
    target = Checkpointable(model=model, optimizer=opt, state=state)
    first = 0
    if spec.get("resume"):
        header = resolve_checkpoint(spec["resume"])
        load_checkpoint(header, target, no_load_optim=False)
        first = state.global_step
    else:
        assert_init_matches(model, torch.load(spec["state"], weights_only=True))
    ctx = ParallelContext(
        rank=rank,
        world_size=world,
        dp_rank=dp_rank,
        dp_size=dp_size,
        dp_group=dp_group,
        pipeline=pipeline,
    )
    step = TrainStep(model, opt, None, max_norm=MAX_NORM, ctx=ctx)
    data = torch.load(spec["data"], weights_only=True)
    per_rank = spec["gbs"] // dp_size
    rows = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    losses, aux = {}, {}
    manager = CheckpointManager(spec["save_path"], save_max=2) if spec.get("save_at") else None
    for s in range(first, data["input_ids"].shape[0]):
        r = step(micro_batches(data, s, rows, spec["lbs"]))
        losses[s], aux[s] = r.loss, r.aux_losses
        state.global_step = s + 1
        if manager is not None and state.global_step == spec["save_at"]:
            manager.save(target, state.global_step)
    if manager is not None:
        manager.close()
    return {"loss": losses, "aux_losses": aux}


def run_workers(world: int, spec: dict[str, Any], timeout: float = 90.0) -> list[dict[str, Any]]:
    """Run ``spec['task']`` on ``world`` spawned gloo ranks; return each rank's JSON result."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": tmp, "timeout": timeout}
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, spec), daemon=True) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
        results = []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.json"
            results.append(
                json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"}
            )
        errors = [
            f"rank {r} (exit code {procs[r].exitcode}): {res.get('error')}"
            for r, res in enumerate(results)
            if not res["ok"]
        ]
        for r in range(world):
            dump = Path(tmp) / f"rank{r}.stacks"
            if dump.exists() and dump.read_text().strip():
                errors.append(f"rank {r} stacks at the timeout:\n{dump.read_text()[-3000:]}")
        if alive:
            errors.insert(0, f"{len(alive)} rank(s) timed out after {timeout}s")
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def expert_bias_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One MoE layer routes this rank's own tokens, then updates its expert bias as parallelize wires it."""
    import torch.distributed as dist

    from lmforge.models.common.moe import MoELayer, RouterSettings
    from lmforge.parallel.api import _sum_expert_counts

    torch.manual_seed(0)
    layer = MoELayer(
        16, 8, RouterSettings(num_experts=4, top_k=2, enable_expert_bias=True, bias_update_rate=0.1)
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(world, 6, 16, generator=torch.Generator().manual_seed(1)) + 0.5
    with torch.no_grad():
        layer(x[rank : rank + 1])
    local = layer.bias_update_counts.tolist()
    _sum_expert_counts(torch.nn.ModuleList([layer]), dist.group.WORLD)
    layer.update_expert_bias()
    return {"local_counts": local, "bias": layer.router.expert_bias.tolist()}


def moe_monitor_records(model: Any, ids: torch.Tensor, path: str) -> list[dict[str, Any]]:
    """What ``monitor.moe_monitor`` (every micro-batch) writes for training forwards+backwards over ``ids``
    (one micro-batch per row)."""
    from lmforge.train.callbacks.monitor_hooks import MoeTokenMonitor

    monitor = MoeTokenMonitor(model, path, interval=1)
    monitor.attach()
    monitor.begin_step(1)
    model.train()
    for row in ids:
        model(row[None], labels=row[None]).loss.backward()
    monitor.close()
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def moe_monitor_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The MoE monitor's records on this rank of ``spec['parallelism']`` (every rank gets the same batch)."""
    model, _, _ = build_parallel(rank, world, spec)
    ids = torch.tensor(spec["ids"])
    return {"records": moe_monitor_records(model, ids, os.path.join(spec["out"], f"tpe{rank}.jsonl"))}


def trained_parameters_task(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train each case of ``spec['cases']`` with the trainer's ``TrainStep``; per step the loss, the
    gradient norm and the logged auxiliary losses, and after the last step this rank's parameters (whole
    tensors, saved to ``{spec['params_dir']}/{case}_rank{rank}.pt``)."""
    from torch.distributed.tensor import DTensor

    from lmforge.train.parallel_seam import ParallelContext
    from lmforge.train.step import TrainStep

    out: dict[str, Any] = {}
    for case in spec["cases"]:
        case = {**spec, **case}
        torch.manual_seed(0)
        model, info, _ = build_parallel(rank, world, case)
        assert_init_matches(model, torch.load(case["state"], weights_only=True))
        data = torch.load(case["data"], weights_only=True)
        ctx = ParallelContext(rank=rank, world_size=world).placed(info)
        step = TrainStep(
            model, make_optimizer(model, case.get("optimizer")), None, max_norm=MAX_NORM, ctx=ctx
        )
        per_rank = case["gbs"] // info.dp_size
        rows = list(range(info.dp_rank * per_rank, (info.dp_rank + 1) * per_rank))
        steps = []
        for s in range(data["input_ids"].shape[0]):
            r = step(micro_batches(data, s, rows, case["lbs"]))
            steps.append({"loss": r.loss, "grad_norm": r.grad_norm, "aux": r.aux_losses})
        params = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()
        }
        torch.save(params, Path(case["params_dir"]) / f"{case['name']}_rank{rank}.pt")
        # Evaluation of the trained model, one micro-batch at a time (as the validation callback runs it).
        evals = []
        for batch in micro_batches(data, 0, list(range(case["gbs"])), case["lbs"])[:2]:
            if info.pipeline is not None:
                loss_sum, tokens = info.pipeline.evaluate_batch(batch)
            else:
                with torch.no_grad():
                    out_ = model(**batch)
                loss_sum, tokens = out_.loss_sum, out_.num_tokens
            evals.append(float(loss_sum) / float(tokens))
        out[case["name"]] = {"steps": steps, "eval": evals}
    return out
