"""Running at 1,000+ GPUs, on paper: communication volume per step per layout, checkpoint size and
save time per rank, start-up cost. Writes the "## Scale on paper" section of docs/benchmarks.md and
prints the tables that docs/parallel.md ("1,000+ GPUs") quotes.

    .venv/bin/python bench/scale.py [--gpus 1024] [--gpus-per-node 8] [--no-write]

Models: the spec's DeepSeek-V3 recipe (configs/muon_deepseek_v3.yaml, about 0.95 B parameters) and
the full-size DeepSeek-V3 (the same family with its published dimensions, 671 B parameters).
Parameter counts come from lmforge's own model built on the meta device (no memory), split into
dense, expert and embedding/output parameters.

Formulas (bytes *sent* per rank per optimizer step; ring collectives: a group of g ranks moves a
fraction a(g) = (g-1)/g of the buffer through every rank; one micro-batch per step, b sequences of s
tokens per data-parallel rank, hidden size h, L layers of which L_moe are MoE, top-k routing):

- FSDP over g ranks of P parameters: all-gather bf16 weights in forward and again in backward
  (reshard after forward), reduce-scatter fp32 gradients (lmforge reduces in fp32):
  (2 + 2 + 4) * P * a(g).
- HSDP, shard group g inside a node, r replicas: the FSDP term on g, plus an fp32 all-reduce of the
  rank's shard across replicas: 2 * 4 * (P / g) * a(r).
- TP t with sequence parallelism: per layer, 2 all-gathers and 2 reduce-scatters of the [b, s, h]
  bf16 activations in forward and as many in backward: 8 * a(t) * b*s*h * 2 * L; weights are
  sharded t ways, the rest is FSDP over N/t ranks.
- EP e: per MoE layer, the dispatch and combine all-to-alls of b*s*k token copies of h bf16 values,
  forward and backward: 4 * a(e) * b*s*k*h * 2 * L_moe; expert weights are sharded e ways and FSDP'd
  over N/e ranks, the rest over N.
- PP p, m micro-batches of b sequences per pipeline (m = p keeps b sequences per GPU): an inner
  stage sends its activations forward and the gradients backward, 2 * m * b*s*h * 2 bytes; each
  stage's P/p parameters are FSDP'd over N/p ranks.

Times are the volume over an assumed per-GPU bandwidth (NVLink inside a node, the network between
nodes; see the constants): an illustration of which layouts are bandwidth-bound, not a measurement.
Checkpoint: fp32 weights plus optimizer state (Muon: one fp32 momentum per matrix of the decoder;
AdamW: two fp32 moments for everything else, the embedding, output layer and norms), sharded evenly
over all ranks by DCP; the save time per rank divides the rank's bytes by the write bandwidth of
this machine's disk (measured here, fsync included) and, separately, the whole checkpoint by an
assumed aggregate file-system bandwidth — the larger of the two bounds the save. Start-up: measured
here — the import of torch + lmforge, the torchrun launch of ``lmforge env`` on 2 ranks, and the
store handshake of utils/elastic.py timed with simulated ranks (threads, one TCPStore client each).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

INTRA_NODE_GBPS = 450.0  # GB/s per GPU inside a node (H100 NVLink 4, one direction)
INTER_NODE_GBPS = 50.0  # GB/s per GPU between nodes (one 400 Gb/s NIC per GPU)
FS_AGGREGATE_GBPS = 200.0  # GB/s for the whole job's parallel file system (assumed)

FULL_DEEPSEEK_V3 = [
    "model.hidden_size=7168",
    "model.intermediate_size=18432",
    "model.moe_intermediate_size=2048",
    "model.num_hidden_layers=61",
    "model.first_k_dense_replace=3",
    "model.num_attention_heads=128",
    "model.q_lora_rank=1536",
    "model.kv_lora_rank=512",
    "model.n_routed_experts=256",
    "model.num_experts_per_tok=8",
    "model.n_group=8",
    "model.topk_group=4",
]


@dataclass
class ModelSizes:
    name: str
    total: int
    expert: int
    embed: int  # embedding + output layer
    muon: int  # matrices of the decoder (Muon's parameters)
    hidden: int
    layers: int
    moe_layers: int
    topk: int
    seq: int
    local_batch: int

    @property
    def dense(self) -> int:
        return self.total - self.expert


def model_sizes(name: str, overrides: list[str]) -> ModelSizes:
    from lmforge.config import load_config
    from lmforge.models import build_model

    cfg = load_config(str(REPO / "configs" / "muon_deepseek_v3.yaml"), overrides)
    model = build_model(cfg.model, device="meta")
    total = expert = embed = muon = 0
    for n, p in model.named_parameters():
        total += p.numel()
        if ".experts." in n:
            expert += p.numel()
        if "word_embeddings" in n or "output_layer" in n:
            embed += p.numel()
        elif p.ndim >= 2 and ".router." not in n:
            muon += p.numel()
    m = cfg.model
    layers = int(m.num_hidden_layers)
    return ModelSizes(
        name,
        total,
        expert,
        embed,
        muon,
        int(m.hidden_size),
        layers,
        layers - int(m.first_k_dense_replace),
        int(m.num_experts_per_tok),
        int(m.seq_length),
        int(cfg.training.local_batch_size),
    )


def a(g: int) -> float:
    return (g - 1) / g if g > 1 else 0.0


def fsdp_bytes(params: float, g: int) -> float:
    return 8.0 * params * a(g)


def layouts(n: int, per_node: int) -> list[tuple[str, dict[str, int]]]:
    nodes = n // per_node
    return [
        (f"FSDP {n}", {"fsdp": n}),
        (f"HSDP {per_node} x {nodes}", {"hsdp": per_node, "rep": nodes}),
        (f"TP {per_node} x FSDP {nodes}", {"tp": per_node, "fsdp": nodes}),
        (f"EP {per_node} x FSDP {n}", {"ep": per_node, "fsdp": n}),
        (f"EP 64 x FSDP {n}", {"ep": 64, "fsdp": n}),
        (f"PP {per_node} x FSDP {nodes} (m=8)", {"pp": per_node, "fsdp": nodes, "m": 8}),
    ]


def comm_per_step(ms: ModelSizes, layout: dict[str, int], n: int) -> tuple[float, float, str]:
    """(bytes inside nodes, bytes between nodes, the dominant term) sent per rank per step."""
    tokens_h = ms.local_batch * ms.seq * ms.hidden
    intra = inter = 0.0
    terms: dict[str, float] = {}
    if "hsdp" in layout:
        g, r = layout["hsdp"], layout["rep"]
        terms["shard AG/RS (intra)"] = fsdp_bytes(ms.total, g)
        terms["replica all-reduce (inter)"] = 2 * 4 * (ms.total / g) * a(r)
        intra, inter = terms["shard AG/RS (intra)"], terms["replica all-reduce (inter)"]
    elif "tp" in layout:
        t = layout["tp"]
        terms["TP activations (intra)"] = 8 * a(t) * tokens_h * 2 * ms.layers
        terms["FSDP of P/t (inter)"] = fsdp_bytes(ms.total / t, layout["fsdp"])
        intra, inter = terms["TP activations (intra)"], terms["FSDP of P/t (inter)"]
    elif "ep" in layout:
        e = layout["ep"]
        a2a = 4 * a(e) * tokens_h * ms.topk * 2 * ms.moe_layers
        terms["EP all-to-all"] = a2a
        terms["FSDP dense (inter)"] = fsdp_bytes(ms.dense, n)
        terms["FSDP experts/e (inter)"] = fsdp_bytes(ms.expert / e, n // e)
        if e <= 8:
            intra = a2a
            inter = terms["FSDP dense (inter)"] + terms["FSDP experts/e (inter)"]
        else:
            inter = a2a + terms["FSDP dense (inter)"] + terms["FSDP experts/e (inter)"]
    elif "pp" in layout:
        p, m = layout["pp"], layout["m"]
        # m micro-batches of b sequences per pipeline of p ranks: with m = p, b sequences per GPU as above.
        terms["PP p2p (inter)"] = 2 * m * ms.local_batch * ms.seq * ms.hidden * 2
        terms["FSDP of P/p (inter)"] = fsdp_bytes(ms.total / p, layout["fsdp"])
        inter = terms["PP p2p (inter)"] + terms["FSDP of P/p (inter)"]
    else:
        terms["FSDP AG/RS (inter)"] = fsdp_bytes(ms.total, layout["fsdp"])
        inter = terms["FSDP AG/RS (inter)"]
    dominant = max(terms, key=terms.get)
    return intra, inter, dominant


def checkpoint_bytes(ms: ModelSizes) -> tuple[float, float]:
    """(Muon recipe, AdamW) checkpoint bytes: fp32 weights + fp32 optimizer state."""
    weights = 4.0 * ms.total
    muon = weights + 4.0 * ms.muon + 8.0 * (ms.total - ms.muon)
    adamw = weights + 8.0 * ms.total
    return muon, adamw


def disk_write_gbps(size_mib: int = 256) -> float:
    data = os.urandom(1 << 20) * size_mib
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        path = Path(d) / "probe.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return len(data) / (time.perf_counter() - t0) / 1e9


def import_seconds() -> float:
    code = "import torch, lmforge.train.builder, lmforge.cli.train"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torchrun_env_seconds() -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--monitor-interval=0.2", "-m", "lmforge", "env"]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def handshake_seconds(world: int) -> float:
    """utils/elastic.agree_generation with ``world`` simulated ranks on one real TCPStore."""
    import torch.distributed as dist

    from lmforge.utils.elastic import agree_generation

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(world)]
    results: list[int] = [0] * world

    def join(r: int) -> None:
        results[r] = agree_generation(clients[r], r, world, 120.0)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    assert len(set(results)) == 1, results
    return elapsed


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    n, per_node = args.gpus, args.gpus_per_node
    load = os.getloadavg()[0]

    models = [
        model_sizes("spec recipe (configs/muon_deepseek_v3.yaml)", []),
        model_sizes("DeepSeek-V3 full size", FULL_DEEPSEEK_V3),
    ]
    out = [
        f"## Scale on paper\n\n`bench/scale.py` ({n} GPUs, {per_node} per node; load average {load:.1f} at start).\n"
    ]
    out.append(
        f"Bandwidth assumptions for the time columns: {INTRA_NODE_GBPS:g} GB/s per GPU inside a node, "
        f"{INTER_NODE_GBPS:g} GB/s per GPU between nodes, {FS_AGGREGATE_GBPS:g} GB/s aggregate file system. "
        "Formulas: the script's docstring and docs/parallel.md.\n"
    )
    for ms in models:
        out.append(
            f"### {ms.name}\n\n{ms.total / 1e9:,.2f} B parameters ({ms.expert / 1e9:,.2f} B in experts, "
            f"{ms.embed / 1e9:,.2f} B in embedding + output); {ms.local_batch} x {ms.seq} tokens per "
            f"data-parallel rank per step.\n"
        )
        out.append(
            "| layout | GB sent per rank per step: inside nodes | between nodes | comm time (s) | largest term |"
        )
        out.append("|---|---:|---:|---:|---|")
        for label, layout in layouts(n, per_node):
            if "ep" in layout and layout["ep"] > 8 and ms.expert == 0:
                continue
            intra, inter, dominant = comm_per_step(ms, layout, n)
            t = intra / (INTRA_NODE_GBPS * 1e9) + inter / (INTER_NODE_GBPS * 1e9)
            out.append(f"| {label} | {gb(intra)} | {gb(inter)} | {t:.3f} | {dominant} |")
        out.append("")
    write_bw = disk_write_gbps()
    out.append(
        f"### Checkpoint per rank ({n} ranks; this machine's disk writes {write_bw:.2f} GB/s with fsync)\n"
    )
    out.append(
        "| model | optimizer | checkpoint GB | GB per rank | s per rank at this disk's speed | s for the job at the file system's aggregate |"
    )
    out.append("|---|---|---:|---:|---:|---:|")
    for ms in models:
        for opt, size in zip(("Muon", "AdamW"), checkpoint_bytes(ms)):
            per_rank = size / n
            out.append(
                f"| {ms.name} | {opt} | {gb(size)} | {per_rank / 1e9:,.3f} | {per_rank / (write_bw * 1e9):.2f} | "
                f"{size / (FS_AGGREGATE_GBPS * 1e9):.1f} |"
            )
    imp = import_seconds()
    launch = torchrun_env_seconds()
    hs = {w: handshake_seconds(w) for w in (8, 64, 256, 512)}
    per_rank_ms = (hs[512] - hs[64]) / (512 - 64) * 1e3
    out.append("\n### Start-up (measured on this machine)\n")
    out.append("| what | seconds |")
    out.append("|---|---:|")
    out.append(f"| import torch + lmforge's trainer (median of 3) | {imp:.2f} |")
    out.append(
        f"| torchrun --standalone, 2 ranks, `lmforge env` (launch, rendezvous, process group, exit) | {launch:.2f} |"
    )
    for w, s in hs.items():
        out.append(f"| store handshake (utils/elastic.py), {w} simulated ranks on one TCPStore | {s:.3f} |")
    out.append(
        f"| store handshake extrapolated to {n} ranks ({per_rank_ms:.2f} ms per rank, linear) | "
        f"{hs[512] + per_rank_ms * (n - 512) / 1e3:.2f} |"
    )
    out.append(
        f"\nMachine: {platform.processor() or platform.machine()}, {os.cpu_count()} vCPUs, Python "
        f"{platform.python_version()}, torch {__import__('torch').__version__}.\n"
    )
    text = "\n".join(out)
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(Path(__file__).parent))
        from benchdoc import write_section

        write_section("## Scale on paper", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
