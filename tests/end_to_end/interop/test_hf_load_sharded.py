"""Hugging Face directories written by transformers' ``save_pretrained`` (several shards), loaded into
parallel lmforge models on 2 and 4 gloo ranks (FSDP, TP, PP, EP, MLA under TP, FSDP×TP, EP×TP, PP×FSDP,
HSDP): every layout ends with bit for bit the weights of a single-process load (``load_hf_pretrained``,
which reads whole tensors), and every rank reads exactly the bytes of its own shards, no more.
One spawn per world size runs all its layouts."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lmforge.config import validate_section

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def _hf_model(family: str):
    import transformers as tf

    if family.startswith("llama"):
        tied = {"tie_word_embeddings": family == "llama_tied"}
        cfg = tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 4, **tied}, num_key_value_heads=2)
        cls = tf.LlamaForCausalLM
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
        )
        cls = tf.Qwen3MoeForCausalLM
    else:
        cfg = tf.DeepseekV3Config(
            **COMMON,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            first_k_dense_replace=1,
            num_mtp_layers=0,
        )
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float()
    with torch.no_grad():  # HF starts these at constants; random values show a misplaced row
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


CASES = {
    2: [
        ("fsdp", "llama", {}),
        ("tp", "llama", {"tensor_parallel": 2}),
        ("pp", "llama", {"pipeline_parallel": 2}),
        ("pp_tied_embeddings", "llama_tied", {"pipeline_parallel": 2}),
        ("ep", "qwen3_moe", {"expert_parallel": 2}),
        # TP alone leaves experts and embeddings replicated: the exact per-rank byte count still holds.
        ("tp_moe", "qwen3_moe", {"tensor_parallel": 2}),
        ("tp_mla", "deepseek_v3", {"tensor_parallel": 2}),
    ],
    4: [
        ("fsdp_x_tp", "llama", {"tensor_parallel": 2}),
        ("pp_x_fsdp", "llama", {"pipeline_parallel": 2}),
        ("hsdp", "llama", {"data_parallel_shard": 2}),
        ("ep_x_tp", "qwen3_moe", {"expert_parallel": 2, "tensor_parallel": 2}),
    ],
}


REPLICATED_EXPERTS = {"tp_moe", "tp_mla"}


def _worker(rank: int, world: int, init: str, root: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lmforge.models import build_model, hf_read, load_hf_weights
    from lmforge.models.common.init import canonical_name
    from lmforge.parallel import ParallelDims, parallelize

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    read = [0]
    real = hf_read.read_slice

    def counting(handle, name, index):
        values = real(handle, name, index)
        read[0] += values.numel() * values.element_size()
        return values

    hf_read.read_slice = counting
    results = {}
    try:
        for case, family, par in CASES[world]:
            hf = Path(root) / family
            section = json.loads((hf / "section.json").read_text())
            reference = torch.load(hf / "reference.pt", weights_only=True)
            par = validate_section("parallelism", par)
            dims = ParallelDims.from_section(par, world)
            model = build_model(validate_section("model", section), device="meta")
            model, _ = parallelize(model, dims, dims.build_mesh("cpu"), par, num_microbatches=4)
            model.to_empty(device="cpu")
            model.init_weights(1000 + rank)  # a different init per rank: the load must overwrite all of it
            read[0] = 0
            load_hf_weights(model, hf)
            differ, expected, names = [], 0, []
            tensors = [*model.named_parameters(), *model.named_buffers()]
            for name, t in tensors:
                name = canonical_name(name)
                if name not in reference:
                    continue
                full = t.full_tensor() if isinstance(t, DTensor) else t
                names.append(name)
                expected += (t.to_local() if isinstance(t, DTensor) else t).numel() * 4  # float32 files
                if not torch.equal(full, reference[name]):
                    differ.append(name)
            if case == CASES[world][0][0]:  # llama: a shard missing, every rank must raise (not hang)
                try:
                    load_hf_weights(model, Path(root) / "broken")
                except Exception as exc:  # noqa: BLE001 (reported to the test)
                    results["error"] = f"{type(exc).__name__}: {exc}"
            results[case] = {"differ": differ, "read": read[0], "expected": expected, "names": names}
    finally:
        (Path(root) / f"w{world}_rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """save_pretrained of tiny random transformers models, cut into several shards, with the reference
    weights of a single-process whole-tensor load."""
    from lmforge.models import load_hf_pretrained
    from lmforge.models.hf_io import section_from_hf_config

    root = tmp_path_factory.mktemp("hfread")
    totals = {}
    for family in ("llama", "llama_tied", "qwen3_moe", "deepseek_v3"):
        path = root / family
        _hf_model(family).save_pretrained(path, max_shard_size="40KB")
        assert len(list(path.glob("model-*.safetensors"))) > 1
        section = section_from_hf_config(json.loads((path / "config.json").read_text()))
        (path / "section.json").write_text(json.dumps(section))
        reference = load_hf_pretrained(path).state_dict()
        torch.save(reference, path / "reference.pt")
        totals[family] = {k: v.numel() * 4 for k, v in reference.items()}
    shutil.copytree(root / "llama", root / "broken")
    sorted((root / "broken").glob("model-*.safetensors"))[0].unlink()
    return root, totals


def _run(world: int, root: Path) -> list[dict]:
    init = tempfile.mktemp(dir=root)
    mp.start_processes(_worker, args=(world, init, str(root)), nprocs=world, start_method="spawn")
    return [json.loads((root / f"w{world}_rank{r}.json").read_text()) for r in range(world)]


def test_single_process_load_equals_whole_tensor_reference_and_reads_each_byte_once(hf_dirs):
    from lmforge.models import build_model, hf_read, load_hf_weights

    root, totals = hf_dirs
    for family in ("llama", "llama_tied", "qwen3_moe", "deepseek_v3"):
        reference = torch.load(root / family / "reference.pt", weights_only=True)
        model = build_model(
            validate_section("model", json.loads((root / family / "section.json").read_text()))
        )
        read = [0]
        real = hf_read.read_slice

        def counting(handle, name, index, read=read, real=real):
            values = real(handle, name, index)
            read[0] += values.nbytes
            return values

        try:
            hf_read.read_slice = counting
            load_hf_weights(model, root / family)
        finally:
            hf_read.read_slice = real
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in reference.items()), family
        assert read[0] == sum(totals[family].values()), family


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_shards_and_gets_the_exact_weights(hf_dirs, world):
    root, totals = hf_dirs
    results = _run(world, root)
    for case, family, _ in CASES[world]:
        seen = set()
        for rank, result in enumerate(results):
            r = result[case]
            assert r["differ"] == [], f"{case} rank {rank}: {r['differ'][:4]} differ from the reference"
            # Exactly its own shards' bytes (each element once), a fraction of the model when sharded.
            assert r["read"] == r["expected"], (
                f"{case} rank {rank}: read {r['read']} bytes, holds {r['expected']}"
            )
            seen.update(r["names"])
        assert seen == set(totals[family]), case  # every tensor was loaded on some rank
        if case not in REPLICATED_EXPERTS:
            whole = sum(totals[family].values())
            most = max(result[case]["read"] for result in results)
            assert most < 0.7 * whole, f"{case}: a rank read {most} of {whole} bytes"
    for rank, result in enumerate(results):
        assert (
            "CheckpointError" in result["error"] and "listed in the safetensors index" in result["error"]
        ), rank


def test_an_unreadable_shard_is_a_checkpoint_error_naming_the_file(hf_dirs, tmp_path):
    from lmforge.errors import CheckpointError
    from lmforge.models import build_model, load_hf_weights

    root, _ = hf_dirs
    shutil.copytree(root / "llama", tmp_path / "hf")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    model = build_model(validate_section("model", json.loads((root / "llama" / "section.json").read_text())))
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a readable safetensors file"):
        load_hf_weights(model, tmp_path / "hf")
