"""GPTDataset samples: Megatron-Core's own GPTDataset as the reference, and hand-computed masks."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

from lmforge.data import build_dataset
from lmforge.data.gpt_dataset import actual_seq_len, make_sample_columns
from lmforge.errors import ConfigError, DataError

from .helpers import TOY_DOCS, loader_section, random_docs, typed, write_docs


def megatron_build(cfg_kwargs: dict, sizes: list):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip(
            "megatron.core.datasets.gpt_dataset", reason="megatron-core (dev extra) is not installed"
        )
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        tokenizer = types.SimpleNamespace(eod=0, pad=-1, vocab_size=500, unique_identifiers={"class": "Test"})
        config = GPTDatasetConfig(tokenizer=tokenizer, **cfg_kwargs)
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


FLAGS = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
NO_FLAGS = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "flags", "sizes", "phase"),
    [
        ("one prefix, split", FLAGS, [120, 30, None], "train"),
        ("one prefix, split", NO_FLAGS, [120, 30, None], "valid"),
        ("one prefix, one epoch", FLAGS, [None, None, None], "train"),
        ("no extra token", {**FLAGS, "add_extra_token_to_sequence": False}, [200, 10, None], "train"),
        (
            "partial valid sample",
            {**NO_FLAGS, "drop_last_partial_validation_sequence": False},
            [50, None, None],
            "valid",
        ),
        ("weighted blend", FLAGS, [150, 20, 0], "train"),
        ("weighted blend", NO_FLAGS, [150, 20, 0], "valid"),
        ("unweighted blend", NO_FLAGS, [100, None, None], "train"),
        ("unweighted blend", NO_FLAGS, [None, None, None], "valid"),
        ("per-split blend", FLAGS, [90, 40, None], "valid"),
    ],
)
def test_same_samples_in_the_same_order_as_megatron(tmp_path, case, flags, sizes, phase):
    a = write_docs(tmp_path / "a", random_docs(1, 70))
    b = write_docs(tmp_path / "b", random_docs(2, 40, max_len=150))
    ours_cfg = {"seq_length": 16, "seed": 4321, "eod": 0, "create_attention_mask": True, **flags}
    theirs_cfg = {"random_seed": 4321, "sequence_length": 16, "create_attention_mask": True, **flags}
    if case == "weighted blend":
        ours_cfg.update(data_path=["0.7", a, "0.3", b], split="80,20,0")
        theirs_cfg.update(blend=([a, b], [0.7, 0.3]), split="80,20,0")
    elif case == "unweighted blend":
        ours_cfg.update(data_path=[a, b], split="85,15,0")
        theirs_cfg.update(blend=([a, b], None), split="85,15,0")
    elif case == "per-split blend":
        ours_cfg.update(train_data_path=["1", a, "2", b], valid_data_path=["1", a, "1", b])
        theirs_cfg.update(blend_per_split=[([a, b], [1.0, 2.0]), ([a, b], [1.0, 1.0]), None])
    else:
        ours_cfg.update(data_path=[a], split="85,15,0")
        theirs_cfg.update(blend=([a], None), split="85,15,0")
    ours_cfg["path_to_cache"] = str(tmp_path / "ours_cache")
    theirs_cfg["path_to_cache"] = None  # Megatron caches blends only under torch.distributed
    section = loader_section(ours_cfg, sizes=sizes, columns=["input_ids"])
    ours, _ = build_dataset(typed(section), phase=phase)
    theirs = megatron_build(theirs_cfg, sizes)[{"train": 0, "valid": 1}[phase]]
    assert len(ours) == len(theirs) > 0
    for k in range(len(ours)):
        mine, ref = ours[k], theirs[k]
        np.testing.assert_array_equal(mine["input_ids"], ref["tokens"].numpy(), err_msg=f"sample {k}")
        np.testing.assert_array_equal(mine["labels"], ref["labels"].numpy())
        np.testing.assert_array_equal(mine["loss_mask"], ref["loss_mask"].numpy())
        np.testing.assert_array_equal(mine["position_ids"], ref["position_ids"].numpy())
        np.testing.assert_array_equal(mine["attention_mask"], ref["attention_mask"].numpy())


def gpt_config(config: dict):
    """The typed GPTDataset config of a loader section (validated as load_config validates it)."""
    return typed(loader_section(config)).dataloader.typed.config


def _cfg(**kw):
    return gpt_config({"seq_length": 6, "train_data_path": ["x"], "create_attention_mask": True, **kw})


def test_masks_and_positions_on_a_hand_made_sample():
    tokens = np.array([5, 0, 6, 7, 0, 8])
    labels = np.array([0, 6, 7, 0, 8, 9])
    cfg = _cfg(eod=0, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    out = make_sample_columns(tokens.copy(), labels.copy(), cfg)
    assert out["loss_mask"].tolist() == [1, 0, 1, 1, 0, 1]
    assert out["position_ids"].tolist() == [0, 1, 0, 1, 2, 0]
    allowed = [  # row i may attend to column j (causal, inside its own document)
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert out["attention_mask"].shape == (1, 6, 6)
    assert (~out["attention_mask"][0]).astype(int).tolist() == allowed
    plain = make_sample_columns(tokens.copy(), labels.copy(), _cfg(eod=0))
    assert plain["loss_mask"].tolist() == [1] * 6
    assert plain["position_ids"].tolist() == list(range(6))
    assert (~plain["attention_mask"][0]).astype(int).tolist() == np.tril(np.ones((6, 6), int)).tolist()


def test_compressed_eod_mask():
    # MindSpore Transformers' example: S = 8, documents of 2, 2 and 4 tokens -> [2, 4, 8, 8, ...].
    tokens = np.array([3, 0, 4, 0, 5, 6, 7, 0])
    assert actual_seq_len(tokens == 0, 128).tolist() == [2, 4] + [8] * 126
    cfg = gpt_config(
        {
            "seq_length": 8,
            "train_data_path": ["x"],
            "eod": 0,
            "create_compressed_eod_mask": True,
            "eod_pad_length": 4,
        }
    )
    out = make_sample_columns(tokens.copy(), np.roll(tokens, -1), cfg)
    assert out["actual_seq_len"].tolist() == [2, 4, 8, 8]
    assert "attention_mask" not in out
    with pytest.raises(
        DataError, match=r"Number of EOD tokens \(3\) exceeds compressed_eod_mask_length \(2\)"
    ):
        actual_seq_len(np.array([1, 0, 1, 0, 1, 0, 1, 1]) == 0, 2)


def test_padded_validation_sample_masks_the_padding(tmp_path):
    prefix = write_docs(tmp_path / "toy", TOY_DOCS)
    cfg = {
        "seq_length": 5,
        "eod": 0,
        "valid_data_path": [prefix],
        "drop_last_partial_validation_sequence": False,
    }
    ds, _ = build_dataset(typed(loader_section(cfg)), phase="valid")
    # 13 tokens, S = 5, one extra token: ceil(12 / 5) = 3 samples, the last one padded.
    assert len(ds) == 3
    texts = sorted((ds[k]["input_ids"].tolist(), ds[k]["loss_mask"].tolist()) for k in range(3))
    padded = [t for t in texts if 0.0 in t[1] and t[1][-1] == 0.0]
    assert len(padded) == 1
    ids, mask = padded[0]
    assert mask == [1.0, 1.0, 0.0, 0.0, 0.0] and ids[2:] == [0, 0, 0]


def test_index_cache_is_written_and_reused(tmp_path):
    prefix = write_docs(tmp_path / "a", random_docs(5, 30))
    cfg = {
        "seq_length": 8,
        "eod": 0,
        "data_path": [prefix],
        "split": "1",
        "path_to_cache": str(tmp_path / "cache"),
    }
    first, _ = build_dataset(typed(loader_section(cfg)), phase="train")
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 4 and any(f.endswith("-GPTDataset-train-shuffle_index.npy") for f in files)
    second, _ = build_dataset(typed(loader_section(cfg)), phase="train")
    assert isinstance(second.shuffle_index.base, np.memmap)  # loaded from the cache, not rebuilt
    assert not isinstance(first.shuffle_index.base, np.memmap)
    np.testing.assert_array_equal(first.sample_index, second.sample_index)
    np.testing.assert_array_equal(first.shuffle_index, second.shuffle_index)


def test_default_cache_is_next_to_the_data(tmp_path):
    prefix = write_docs(tmp_path / "a", random_docs(5, 30))
    build_dataset(typed(loader_section({"seq_length": 8, "train_data_path": [prefix]})), phase="train")
    assert len(list((tmp_path / "cache" / "GPTDataset_indices").glob("*.npy"))) == 3


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train_data_path": ["x"]}, r"config\.seq_length is required"),
        ({"seq_length": 8}, r"names no data"),
        ({"seq_length": 8, "data_path": ["x"]}, r"config\.split is required"),
        ({"seq_length": 8, "data_path": ["x"], "train_data_path": ["y"], "split": "1"}, "mutually exclusive"),
        ({"seq_length": 8, "train_data_path": ["x"], "eod_mask_loss": True}, r"config\.eod"),
        ({"seq_length": 8, "train_data_path": ["x"], "sequence_len": 3}, r"config\.sequence_len is not"),
        ({"seq_length": 8, "train_data_path": ["x"], "reset_position_ids": "yes"}, "true or false"),
        ({"seq_length": 8, "data_path": ["x"], "split": "0,0,0"}, r"config\.split"),
        ({"seq_length": 8, "data_path": ["0", "x"], "split": "1"}, "weight must be > 0"),
    ],
)
def test_config_errors_name_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        gpt_config(config)


def test_eod_outside_the_vocabulary():
    with pytest.raises(ConfigError, match=r"config\.eod = 9000 .*model\.vocab_size = 8192"):
        loader = typed(loader_section({"seq_length": 8, "train_data_path": ["x"], "eod": 9000})).dataloader
        loader.typed.check_against_model(None, 8192)


def test_the_typed_config_keeps_defaults_reads_aliases_and_names_every_problem():
    cfg = gpt_config(
        {"seq_length": 8, "train_data_path": ["x"], "eod_mask_loss": None, "compressed_eod_mask_length": 16}
    )
    assert (cfg.eod_mask_loss, cfg.eod_pad_length, cfg.seed, cfg.split_weights) == (False, 16, 1234, None)
    assert gpt_config({"seq_length": 8, "data_path": ["x"], "split": 3}).split_weights == [1.0, 0.0, 0.0]
    with pytest.raises(ConfigError) as info:
        gpt_config({"seq_length": 8, "train_data_path": ["x"], "pad": -2, "mmap_bin_files": 1})
    text = str(info.value)
    assert "2 problems" in text
    assert (
        "config.pad must be >= -1; got -2" in text and "config.mmap_bin_files must be true or false" in text
    )


def test_weights_need_sizes(tmp_path):
    a = write_docs(tmp_path / "a", random_docs(1, 20))
    b = write_docs(tmp_path / "b", random_docs(2, 20))
    section = loader_section({"seq_length": 8, "data_path": ["1", a, "1", b], "split": "1"})
    with pytest.raises(DataError, match="need a sample count"):
        build_dataset(typed(section), phase="train")


def test_missing_prefix_is_named(tmp_path):
    section = loader_section(
        {"seq_length": 8, "data_path": ["1", str(tmp_path / "nope")], "split": "1"}, sizes=[4]
    )
    with pytest.raises(
        DataError, match=r"train_dataset\.dataloader\.config\.data_path: no Megatron dataset at .*nope"
    ):
        build_dataset(typed(section), phase="train")
