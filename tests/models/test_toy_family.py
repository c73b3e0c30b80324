"""A model family defined entirely in this module, registered at run time, used end to end.

``toy_gelu`` / ``ToyGeluForCausalLM``: Llama's GQA attention with a non-gated GELU MLP (not a block the
shipped families have) and a family-only key, ``gelu_approximate``. Nothing under ``src/`` names it:
the registry, the build, ``lmforge check``, ``lmforge train`` and the Hugging Face writer and reader
must all work from its ``Family`` declaration alone (docs/models.md, "Adding a family").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.models import (
    Family,
    GPTModel,
    HFAdapter,
    TransformerConfig,
    build_model,
    build_model_config,
    families,
    load_hf_pretrained,
    load_hf_weights,
    registry,
    save_hf_pretrained,
)
from lmforge.models.common import hf_names as h
from lmforge.models.common.blocks import LayerBlocks, gqa_attention
from lmforge.models.common.config_keys import FamilyKeys
from lmforge.models.common.family_build import common_fields, positive_int
from lmforge.models.common.section import FamilySection
from lmforge.models.common.tp_plan import ColwiseShard, ReplicateInput, RowwiseShard, gqa_attention_plan

TOY = "toy_gelu"
VOCAB = 64


class GeluMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate
        self.linear_fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))

    def flops_per_token(self, hidden_size: int) -> float:
        return 2 * 2 * hidden_size * self.linear_fc1.out_features


def gelu_mlp(cfg: TransformerConfig, layer_id: int) -> GeluMLP:
    return GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.family_options["gelu_approximate"])


class ToyGeluForCausalLM(GPTModel):
    model_type = TOY
    blocks = LayerBlocks(attention=gqa_attention, mlp=gelu_mlp)


KEYS = FamilyKeys(
    model_type=TOY,
    architectures=("ToyGeluForCausalLM",),
    hf={
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": None,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_parameters": None,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
        "initializer_range": 0.02,
        "gelu_approximate": "none",
    },
)


def to_transformer_config(values: FamilySection) -> TransformerConfig:
    approximate = values.gelu_approximate
    if approximate not in ("none", "tanh"):
        raise ConfigError(f"model.gelu_approximate = {approximate!r} is not valid; use 'none' or 'tanh'.")
    return TransformerConfig(
        model_type=TOY,
        architectures="ToyGeluForCausalLM",
        intermediate_size=positive_int(values.intermediate_size, "intermediate_size"),
        family_options={"gelu_approximate": approximate},
        **common_fields(values, family_qk_norm=False, family_mla=False),
    )


def from_hf(hf: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_from_hf(hf, cfg, out)
    for i in range(cfg.num_layers):
        hp, lp = h.HF.format(i=i), h.LM.format(i=i)
        h.norms_from_hf(hf, hp, lp, out)
        h.gqa_attention_from_hf(hf, hp, lp, cfg, out)
        out[f"{lp}mlp.linear_fc1.weight"] = h.take(hf, f"{hp}mlp.fc_in.weight")
        out[f"{lp}mlp.linear_fc2.weight"] = h.take(hf, f"{hp}mlp.fc_out.weight")
    return out


def to_hf(sd: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_to_hf(sd, cfg, out)
    for i in range(cfg.num_layers):
        hp, lp = h.HF.format(i=i), h.LM.format(i=i)
        h.norms_to_hf(sd, hp, lp, out)
        h.gqa_attention_to_hf(sd, hp, lp, cfg, out)
        out[f"{hp}mlp.fc_in.weight"] = sd[f"{lp}mlp.linear_fc1.weight"]
        out[f"{hp}mlp.fc_out.weight"] = sd[f"{lp}mlp.linear_fc2.weight"]
    return out


def hf_config(cfg: TransformerConfig) -> dict:
    out = {**h.base_hf_config(cfg), "head_dim": cfg.head_dim, **cfg.family_options}
    out.pop("hidden_act")  # the base writes SwiGLU's "silu"; this family's activation is gelu_approximate
    return out


def tp_plan(cfg: TransformerConfig, layer_id: int) -> dict:
    return {
        **gqa_attention_plan(cfg),
        "mlp": (ReplicateInput(),),
        "mlp.linear_fc1": (ColwiseShard(cfg.intermediate_size, "FFN width"),),
        "mlp.linear_fc2": (RowwiseShard(),),
    }


TOY_FAMILY = Family(
    keys=KEYS,
    model_classes={"ToyGeluForCausalLM": ToyGeluForCausalLM},
    to_transformer_config=to_transformer_config,
    hf_adapter=HFAdapter(from_hf, to_hf, hf_config),
    tp_plan=tp_plan,
    aliases=("toy_gelu_alias",),
)


@pytest.fixture
def toy():
    registry.register(TOY_FAMILY)
    yield TOY_FAMILY
    registry.unregister(TOY)


def section(**overrides) -> dict:
    return {
        "model_type": TOY,
        "architectures": "ToyGeluForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": VOCAB,
        "seq_length": 16,
        "compute_dtype": "float32",
        **overrides,
    }


def test_the_shipped_families_are_discovered_from_their_folders():
    known = families()
    assert {"llama", "qwen3", "qwen3_moe", "deepseek_v3"} <= set(known)
    assert TOY not in known
    assert registry.model_type_aliases()["deepseek_mtp"] == "deepseek_v3"
    for name, family in known.items():
        assert family.model_type == name
        assert family.model_classes[family.keys.architectures[0]].__module__.startswith(
            f"lmforge.models.{name}."
        )


def test_unknown_names_keep_their_errors(toy):
    with pytest.raises(
        ConfigError, match=r"'toy_gelx' is not a known model type; known: .*toy_gelu, toy_gelu_alias"
    ):
        build_model_config(validate_section("model", section(model_type="toy_gelx")))
    with pytest.raises(
        ConfigError, match=r"does not match model.model_type = 'toy_gelu'; use ToyGeluForCausalLM"
    ):
        build_model_config(validate_section("model", section(architectures="LlamaForCausalLM")))
    with pytest.raises(
        ConfigError, match=r"model.gelu_aproximate is not a key .* Did you mean 'gelu_approximate'"
    ):
        build_model_config(validate_section("model", section(gelu_aproximate="tanh")))
    with pytest.raises(ConfigError, match=r"model.gelu_approximate = 'erf' is not valid"):
        build_model_config(validate_section("model", section(gelu_approximate="erf")))
    assert (
        build_model_config(validate_section("model", section(model_type="toy_gelu_alias"))).model_type == TOY
    )


def test_register_refuses_a_taken_name(toy):
    import dataclasses

    clash = dataclasses.replace(TOY_FAMILY, aliases=())
    with pytest.raises(ValueError, match="already registered"):
        registry.register(clash)
    registry.register(TOY_FAMILY)  # the same object again: a no-op


def test_the_toy_blocks_compute_what_the_family_declares(toy):
    model = build_model(validate_section("model", section(gelu_approximate="tanh")), seed=1)
    assert isinstance(model, ToyGeluForCausalLM)
    mlp = model.decoder.layers[1].mlp
    assert isinstance(mlp, GeluMLP) and mlp.approximate == "tanh"
    x = torch.randn(2, 5, 32)
    # The tanh approximation written out (Hendrycks & Gimpel), not torch's gelu.
    u = x @ mlp.linear_fc1.weight.T
    act = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    torch.testing.assert_close(mlp(x), act @ mlp.linear_fc2.weight.T, rtol=1e-5, atol=1e-6)
    out = model(torch.randint(0, VOCAB, (2, 8)), labels=torch.randint(0, VOCAB, (2, 8)))
    assert model(torch.randint(0, VOCAB, (2, 8))).logits.shape == (2, 8, VOCAB) and torch.isfinite(out.loss)
    assert model.flops_per_token(8) > 0
    # Optimizer hooks come from the blocks: GQA's fused QKV pieces and QK-Clip; the GELU MLP has none.
    assert set(model.muon_split_schema()) == {
        f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in (0, 1)
    }
    assert len(model.qk_clip_layers()) == 2


def test_hugging_face_round_trip_is_exact(toy, tmp_path):
    model = build_model(validate_section("model", section()), seed=3)
    save_hf_pretrained(model, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == TOY and written["architectures"] == ["ToyGeluForCausalLM"]
    loaded = load_hf_pretrained(tmp_path / "hf")
    assert isinstance(loaded, ToyGeluForCausalLM)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    fresh = build_model(validate_section("model", section()), seed=4)
    load_hf_weights(fresh, tmp_path / "hf")
    assert all(torch.equal(ours[k], fresh.state_dict()[k]) for k in ours)


def test_a_family_without_a_tp_plan_refuses_tensor_parallel_at_check(tmp_path, capsys):
    import dataclasses

    from lmforge.cli import main

    registry.register(dataclasses.replace(TOY_FAMILY, tp_plan=None))
    try:
        cfg = _write_run(tmp_path, section(), parallelism={"tensor_parallel": 2})
        assert main(["check", "--config", cfg, "--world-size", "2"]) != 0
        captured = capsys.readouterr()
        assert "model_type 'toy_gelu' declares no tensor-parallel plan" in captured.out + captured.err
    finally:
        registry.unregister(TOY)


def _write_run(tmp_path, model_section: dict, **sections) -> str:
    from lmforge.data import IndexedDatasetWriter

    prefix = tmp_path / "data" / "docs"
    prefix.parent.mkdir()
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(40):
            start, n = int(rng.integers(1, VOCAB)), int(rng.integers(10, 30))
            writer.add_document([1 + (start + i) % (VOCAB - 1) for i in range(n)] + [0])
    raw = {
        "output_dir": str(tmp_path / "run"),
        "training": {"steps": 2, "local_batch_size": 2, "global_batch_size": 2, "seed": 3},
        "optimizer": {"type": "AdamW", "weight_decay": 0.01},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1.0e-2, "warmup_steps": 0},
        "checkpoint": {"enable_save": False},
        "model": model_section,
        **sections,
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "datasets_type": "GPTDataset",
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "config": {
                    "seq_length": 16,
                    "eod": 0,
                    "data_path": [str(prefix)],
                    "split": "100,0,0",
                    "path_to_cache": str(tmp_path / "cache"),
                },
            },
            "num_parallel_workers": 0,
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_lmforge_check_and_train_run_the_toy_family(toy, tmp_path, capsys):
    from lmforge.cli import main
    from lmforge.train.callbacks import read_metrics

    cfg = _write_run(tmp_path, section())
    assert main(["check", "--config", cfg]) == 0
    (tmp_path / "bad").mkdir()
    assert main(["check", "--config", _write_run(tmp_path / "bad", section(gelu_aproximate="tanh"))]) != 0
    captured = capsys.readouterr()
    assert "Did you mean 'gelu_approximate'" in captured.out + captured.err
    assert main(["train", "--config", cfg]) == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    assert records[1]["loss"] != records[0]["loss"]


def _entry_point_dist(where, name: str, target: str) -> None:
    """A minimal installed-distribution record whose metadata declares one ``lmforge.models`` entry point."""
    dist = where / f"{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[lmforge.models]\n{name} = {target}\n")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_toy_family_tensor_parallel_plan_matches_one_process(toy, tmp_path):
    """The toy's declared TP plan under torchrun (tp=2, fp32) reproduces the one-process losses and
    gradient norms. The workers find the family through an entry point naming this module."""
    from lmforge.cli import main
    from lmforge.train.callbacks import read_metrics

    (tmp_path / "one").mkdir()
    (tmp_path / "tp").mkdir()
    assert main(["train", "--config", _write_run(tmp_path / "one", section())]) == 0
    cfg = _write_run(tmp_path / "tp", section(), parallelism={"tensor_parallel": 2})
    _entry_point_dist(tmp_path / "plugin", "toy_gelu", "test_toy_family:TOY_FAMILY")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([str(tmp_path / "plugin"), here, os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "lmforge", "train", "--config", cfg]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    one = read_metrics(tmp_path / "one" / "run" / "metrics.jsonl")
    tp = read_metrics(tmp_path / "tp" / "run" / "metrics.jsonl")
    assert len(one) == len(tp) == 2
    for a, b in zip(one, tp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_a_family_from_an_entry_point_is_discovered(tmp_path, monkeypatch):
    """A package outside lmforge declares ``[lmforge.models]`` in its metadata; discovery loads it."""
    pkg = tmp_path / "toy_plugin_family"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            import dataclasses
            import sys
            base = sys.modules["toy_family_under_test"].TOY_FAMILY
            keys = dataclasses.replace(base.keys, model_type="toy_plugin")
            FAMILY = dataclasses.replace(base, keys=keys, aliases=())
            """
        )
    )
    _entry_point_dist(tmp_path, "toy_plugin", "toy_plugin_family:FAMILY")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "toy_family_under_test", sys.modules[__name__])
    monkeypatch.setattr(registry, "_discovered", False)
    try:
        found = families()
        assert "toy_plugin" in found
        assert build_model_config(
            validate_section("model", section(model_type="toy_plugin"))
        ).family_options == {"gelu_approximate": "none"}
    finally:
        registry.unregister("toy_plugin")
        sys.modules.pop("toy_plugin_family", None)
