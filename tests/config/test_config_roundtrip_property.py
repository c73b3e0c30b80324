"""Property: a valid configuration survives dump -> load unchanged."""

from __future__ import annotations

import keyword
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.config import dump_yaml, load_config
from lmforge.config.yaml_io import parse_yaml_text

# Extra keys must not shadow pydantic's own attributes (``copy``, ``json``...) to be readable as
# attributes; the round trip itself does not care, but keep the generated names realistic.
_names = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12).filter(
    lambda s: not keyword.iskeyword(s) and not s.startswith(("model_", "_"))
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, width=64),
    st.text(max_size=20),
    st.sampled_from(["1e-8", "yes", "no", "on", "null", "~", "None", "0x1F", "1_000", "3:30", ".inf"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_names, inner, max_size=3),
    max_leaves=8,
)
# Prefixed so that an extra never replaces a declared field (``type``, ``betas``...).
_extras = st.dictionaries(_names.map(lambda s: "x_" + s), _values, max_size=4)
_unit = st.floats(0.0, 1.0, exclude_max=True)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(1, 12))
    lbs = draw(st.integers(1, 8))
    spec_end = draw(st.integers(0, layers - 1))
    start = draw(st.integers(1, 50))
    cfg: dict[str, Any] = {
        "training": {
            "steps": draw(st.integers(1, 10_000)),
            "local_batch_size": lbs,
            "global_batch_size": lbs * draw(st.integers(1, 8)),
            "max_norm": draw(st.floats(1e-6, 1e3)),
            "seed": draw(st.integers(0, 2**31)),
            "deterministic": draw(st.booleans()),
        },
        "optimizer": {
            "type": draw(st.sampled_from(["AdamW", "Muon"])),
            "betas": [draw(_unit), draw(_unit)],
            "eps": draw(st.floats(1e-12, 1e-3)),
            "weight_decay": draw(st.floats(0.0, 1.0)),
            **draw(_extras),
        },
        "lr_scheduler": {
            "type": "CosineWithWarmUpLR",
            "learning_rate": draw(st.floats(0, 1)),
        },
        "train_dataset": {
            # Typed per loader type at load: its keys other than these are warned about, not refused.
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "config": {"seq_length": 64, "data_path": ["data/a_text_document"], "split": "1"},
                **draw(_extras),
            },
            "num_parallel_workers": draw(st.integers(0, 16)),
        },
        "model": {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            "num_hidden_layers": layers,
            "seq_length": 64,
        },
        "recompute": draw(
            st.sampled_from(
                [
                    {"mode": "None"},
                    {"mode": "full", "full_recompute_layer": [f"0-{spec_end}"]},
                    {"mode": "select", "select_module": {"mlp.*": [str(spec_end)]}},
                ]
            )
        ),
        "profiler": {"start_step": start, "end_step": start + draw(st.integers(0, 5)), "profiler_rank": [0]},
        "monitor": {
            "train_state": {"local_norm": draw(st.sampled_from([True, "", "embedding", ["a", "b"]]))}
        },
        "callbacks": [{"type": "MyCallback", **draw(_extras)}],
        **draw(st.dictionaries(_names.map(lambda s: "x_" + s), _values, max_size=2)),
    }
    return cfg


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_dump_then_load_is_identity(raw: dict[str, Any]) -> None:
    cfg = load_config(raw)
    text = dump_yaml(cfg)
    again = load_config(parse_yaml_text(text))
    assert again.to_dict() == cfg.to_dict()
    assert dump_yaml(again) == text
