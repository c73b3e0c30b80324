"""A Hugging Face directory loaded into an FSDP2-sharded model on 2 gloo ranks: only rank 0 reads
the safetensors files, and every rank ends with its shard of the exact weights."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lmforge.models import build_model, save_hf_pretrained

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SECTION = {
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "compute_dtype": "float32",
}


def _worker(rank: int, world: int, init: str, hf: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lmforge.models import hf_io

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    reads = []
    real = hf_io.read_safetensors_dir
    hf_io.read_safetensors_dir = lambda p: reads.append(str(p)) or real(p)
    result = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(123 + rank)  # different random init per rank: the load must overwrite it
        model = build_model(SECTION)
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        hf_io.load_hf_weights(model, hf)
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, Path(out) / "loaded.pt")
        try:  # a shard missing: rank 0 fails to read, and every rank must raise (not hang)
            hf_io.load_hf_weights(model, str(Path(out) / "broken"))
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["reads"] = len(reads)
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def test_sharded_load_reads_on_rank_0_only(tmp_path):
    torch.manual_seed(0)
    source = build_model(SECTION)
    save_hf_pretrained(source, tmp_path / "hf", max_shard_size="60KB")
    shutil.copytree(tmp_path / "hf", tmp_path / "broken")
    shards = sorted((tmp_path / "broken").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[0].unlink()
    init = tempfile.mktemp(dir=tmp_path)
    mp.start_processes(
        _worker, args=(2, init, str(tmp_path / "hf"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["reads"] for r in results] == [2, 0]  # the good load and the broken one, rank 0 only
    assert all(
        "CheckpointError" in r["error"] and "listed in the safetensors index" in r["error"] for r in results
    )
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    expected = source.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
