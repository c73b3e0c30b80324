"""Every YAML example of the spec documents validates: the skeleton as is, fragments over it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import ConfigError

SPEC_YAMLS = Path(__file__).resolve().parents[1] / "fixtures" / "spec_yamls"
SKELETON = SPEC_YAMLS / "004_skeleton.yaml"
FRAGMENTS = sorted(p for p in SPEC_YAMLS.glob("*.yaml") if p != SKELETON)


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: data}


def test_there_are_examples() -> None:
    assert len(FRAGMENTS) >= 25


def test_skeleton_loads_unchanged() -> None:
    cfg = load_config(SKELETON)
    written = _leaves(yaml.safe_load(SKELETON.read_text(encoding="utf-8")))
    resolved = _leaves(cfg.to_dict())
    for key, value in written.items():
        # The skeleton writes floats as "1.e-8", which plain YAML also reads as floats.
        assert resolved[key] == value, key
    assert cfg.model.model_type == "deepseek_v3" and cfg.training.global_batch_size == 8
    assert cfg.train_dataset.dataloader.config.data_path == ["1", "/path/megatron_data_text_document"]


# Fragments whose schema is valid but whose run lmforge refuses before building anything; `check`
# refuses them with the same reason as `train` (one pre-build validation).
NOT_RUNNABLE = {
    # The spec's placeholder name: no such callback exists.
    "004_callbacks": "callbacks[0].type: unknown callback 'MyCustomCallback'",
}


# Fragments whose data section lmforge cannot read: the dataloader is typed at load, so load_config
# (and with it `check` and `train`) refuses them.
REFUSED_AT_LOAD = {
    # The fragment replaces the skeleton's data section with one that says where no data is.
    "004_train_dataset": "train_dataset.dataloader.config is required",
}


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=[p.stem for p in FRAGMENTS])
def test_fragment_over_the_skeleton_validates(fragment: Path, tmp_path: Path, capsys: Any) -> None:
    base = yaml.safe_load(SKELETON.read_text(encoding="utf-8"))
    overlay = yaml.safe_load(fragment.read_text(encoding="utf-8"))
    assert isinstance(overlay, dict) and overlay
    merged = {**base, **overlay}
    if fragment.stem in REFUSED_AT_LOAD:
        with pytest.raises(ConfigError, match=re.escape(REFUSED_AT_LOAD[fragment.stem])):
            load_config(merged)
        path = tmp_path / "merged.yaml"
        path.write_text(yaml.safe_dump(merged), encoding="utf-8")
        assert main(["check", "--config", str(path)]) == 2
        assert REFUSED_AT_LOAD[fragment.stem] in capsys.readouterr().err
        return
    cfg = load_config(merged)
    for section, value in overlay.items():
        resolved = _leaves(
            getattr(cfg, section).to_dict()
            if section != "callbacks"
            else [c.to_dict() for c in cfg.callbacks]
        )
        for key, expected in _leaves(value).items():
            if key:
                assert resolved[key] == expected, f"{section}.{key}"
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump(merged), encoding="utf-8")
    # The smallest world the layout fits: one data-parallel rank per expert-parallel rank (expert
    # parallelism borrows data x context ranks); the spec's examples pair small batches with it.
    par = cfg.parallelism
    world = par.tensor_parallel * par.pipeline_parallel * par.context_parallel * par.expert_parallel
    code = main(["check", "--config", str(path), "--world-size", str(world)])
    if fragment.stem in NOT_RUNNABLE:
        assert code == 2 and NOT_RUNNABLE[fragment.stem] in capsys.readouterr().err
    else:
        assert code == 0, capsys.readouterr().err
