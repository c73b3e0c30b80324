"""The micro-batch loader: sharding, batching, padding, workers, shuffle and exact resumption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.data import build_dataloader, build_dataset
from lmforge.errors import ConfigError, DataError

from .helpers import loader_section, random_docs, typed, write_docs

COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids"]


@pytest.fixture
def prefix(tmp_path):
    return write_docs(tmp_path / "corpus", random_docs(11, 120, vocab=300))


def section_for(prefix, tmp_path, **kw):
    cfg = {"seq_length": 16, "eod": 0, "train_data_path": [prefix], "path_to_cache": str(tmp_path / "cache")}
    cfg.update(kw.pop("config", {}))
    return typed(loader_section(cfg, **kw))


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_batches_are_dataset_samples_in_order(prefix, tmp_path):
    section = section_for(prefix, tmp_path)
    dataset, _ = build_dataset(section)
    loader = build_dataloader(section, local_batch_size=3)
    batches = take(loader, 4)
    for step, batch in enumerate(batches):
        assert set(batch) == set(COLUMNS)
        assert batch["input_ids"].shape == (3, 16) and batch["input_ids"].dtype == torch.long
        assert batch["loss_mask"].dtype == torch.float32
        for row in range(3):
            sample = dataset[step * 3 + row]
            assert batch["input_ids"][row].tolist() == sample["input_ids"].tolist()
            assert batch["labels"][row].tolist() == sample["labels"].tolist()
    assert loader.state_dict() == {"consumed_samples": 12}


def test_data_parallel_shards_cover_the_global_batch(prefix, tmp_path):
    section = section_for(prefix, tmp_path)
    single = take(build_dataloader(section, local_batch_size=4), 3)
    ranks = [take(build_dataloader(section, local_batch_size=2, dp_rank=r, dp_size=2), 3) for r in range(2)]
    for step in range(3):
        together = torch.cat([ranks[0][step]["input_ids"], ranks[1][step]["input_ids"]])
        assert torch.equal(together, single[step]["input_ids"])
    assert not torch.equal(ranks[0][0]["input_ids"], ranks[1][0]["input_ids"])


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_gives_the_next_batch(prefix, tmp_path, shuffle):
    section = section_for(prefix, tmp_path, shuffle=shuffle)
    reference = build_dataloader(section, local_batch_size=2, dp_rank=1, dp_size=2, seed=7)
    epoch = len(reference)
    uninterrupted = take(reference, epoch + 5)  # runs across the epoch boundary
    state = None
    first = build_dataloader(section, local_batch_size=2, dp_rank=1, dp_size=2, seed=7)
    take(first, epoch - 3)
    state = first.state_dict()
    resumed = build_dataloader(section, local_batch_size=2, dp_rank=1, dp_size=2, seed=7)
    resumed.load_state_dict(state)
    rest = take(resumed, 8)
    for got, want in zip(rest, uninterrupted[epoch - 3 :]):
        for name in COLUMNS:
            assert torch.equal(got[name], want[name])
    # The constructor argument works the same way, and resuming reads none of the skipped samples.
    reads = []
    direct = build_dataloader(
        section, local_batch_size=2, dp_rank=1, dp_size=2, seed=7, consumed_samples=state["consumed_samples"]
    )
    cls = direct.dataset.__class__
    original = cls.fill_row

    def spy(self, k, batch, row):
        reads.append(k)
        return original(self, k, batch, row)

    cls.fill_row = spy
    try:
        assert torch.equal(next(direct)["input_ids"], uninterrupted[epoch - 3]["input_ids"])
    finally:
        cls.fill_row = original
    assert reads == direct.indices_of_step(state["consumed_samples"] // 4)


def test_shuffle_permutes_each_epoch_differently(prefix, tmp_path):
    section = section_for(prefix, tmp_path, shuffle=True)
    loader = build_dataloader(section, local_batch_size=1, seed=3)
    n = len(loader)
    first = [loader.indices_of_step(s)[0] for s in range(n)]
    second = [loader.indices_of_step(n + s)[0] for s in range(n)]
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second and first != list(range(n))


def test_worker_processes_give_the_same_batches(prefix, tmp_path):
    plain = take(build_dataloader(section_for(prefix, tmp_path, workers=1), local_batch_size=4), 5)
    workers = build_dataloader(section_for(prefix, tmp_path, workers=2), local_batch_size=4)
    assert workers.num_workers == 2
    for got, want in zip(take(workers, 5), plain):
        assert torch.equal(got["input_ids"], want["input_ids"])


def test_drop_remainder_false_pads_the_last_step(prefix, tmp_path):
    keep = build_dataloader(
        section_for(prefix, tmp_path, drop_remainder=False), local_batch_size=4, dp_size=2, dp_rank=1
    )
    drop = build_dataloader(section_for(prefix, tmp_path), local_batch_size=4, dp_size=2, dp_rank=1)
    n = keep.num_samples
    assert n % 8 != 0, "the fixture must leave a remainder"
    assert len(drop) == n // 8 and len(keep) == n // 8 + 1
    last = keep.indices_of_step(len(keep) - 1)
    assert None in last
    batch = take(keep, len(keep))[-1]
    padded_rows = [i for i, k in enumerate(last) if k is None]
    assert batch["loss_mask"][padded_rows].sum() == 0
    assert batch["input_ids"].shape == (4, 16)


def test_validation_loader_runs_one_epoch_per_iteration(prefix, tmp_path):
    cfg = {
        "seq_length": 16,
        "eod": 0,
        "data_path": [prefix],
        "split": "80,20,0",
        "path_to_cache": str(tmp_path / "c"),
    }
    section = typed(loader_section(cfg))
    valid = build_dataloader(section, local_batch_size=2, phase="valid")
    first = list(valid)
    assert len(first) == len(valid) > 0
    assert [b["input_ids"].tolist() for b in list(valid)] == [b["input_ids"].tolist() for b in first]
    assert build_dataloader(section, local_batch_size=2, phase="test") is None


def test_compressed_eod_mask_is_cumulative_over_the_batch(prefix, tmp_path):
    section = section_for(
        prefix,
        tmp_path,
        columns=COLUMNS + ["actual_seq_len"],
        config={"create_compressed_eod_mask": True, "eod_pad_length": 8},
    )
    dataset, _ = build_dataset(section)
    batch = next(build_dataloader(section, local_batch_size=3))
    assert batch["actual_seq_len"].shape == (3, 8)
    for row in range(3):
        assert batch["actual_seq_len"][row].tolist() == (dataset[row]["actual_seq_len"] + 16 * row).tolist()


def test_attention_mask_column(prefix, tmp_path):
    section = section_for(
        prefix, tmp_path, columns=COLUMNS + ["attention_mask"], config={"create_attention_mask": True}
    )
    batch = next(build_dataloader(section, local_batch_size=2))
    assert batch["attention_mask"].shape == (2, 1, 16, 16) and batch["attention_mask"].dtype == torch.bool
    assert torch.equal(batch["attention_mask"][0, 0], ~torch.ones(16, 16, dtype=torch.bool).tril())


def test_spec_skeleton_section_feeds_batches(tmp_path):
    """The train_dataset section of the spec's train.yaml skeleton, with only the data path replaced."""
    prefix = write_docs(
        tmp_path / "megatron_data_text_document", random_docs(4, 400, vocab=1000, eod=1, max_len=200)
    )
    section = {
        "dataloader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "datasets_type": "GPTDataset",
            "sizes": [1000, 0, 0],
            "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
            "shuffle": False,
            "config": {
                "seq_length": 64,
                "split": "1, 0, 0",
                "eod": 1,
                "pad": -1,
                "create_attention_mask": False,
                "create_compressed_eod_mask": False,
                "data_path": ["1", prefix],
            },
        },
        "drop_remainder": True,
        "num_parallel_workers": 8,
    }
    section = typed(section)
    loader = build_dataloader(section, local_batch_size=2, vocab_size=1000, seq_length=64)
    assert loader.num_samples == 1000
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 64)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert build_dataloader(section, local_batch_size=2, phase="valid") is None


@pytest.mark.parametrize("kind", ["MindDataset", "OrderedIndexDataLoader", "Whatever"])
def test_unsupported_loader_types_are_refused(kind):
    section = {"dataloader": {"type": kind, "dataset_files": "x"}}
    with pytest.raises(
        ConfigError, match=r"train_dataset\.dataloader\.type .*Supported: BlendedMegatronDatasetDataLoader"
    ):
        typed(section)


@pytest.mark.parametrize(
    ("columns", "config", "message"),
    [
        (["input_ids", "attention_mask"], {"create_attention_mask": False}, "create_attention_mask is false"),
        (["input_ids", "actual_seq_len"], {}, "create_compressed_eod_mask: true"),
        (["input_ids", "tokens"], {}, "contains 'tokens'"),
    ],
)
def test_column_errors(prefix, tmp_path, columns, config, message):
    with pytest.raises(ConfigError, match=rf"column_names .*{message}"):
        section_for(prefix, tmp_path, columns=columns, config=config)


def test_token_ids_beyond_the_vocabulary(prefix, tmp_path):
    with pytest.raises(DataError, match=r"token id 29\d, but model\.vocab_size is 100"):
        build_dataloader(section_for(prefix, tmp_path), local_batch_size=1, vocab_size=100)


def test_seq_length_must_match_the_model(prefix, tmp_path):
    with pytest.raises(ConfigError, match=r"config\.seq_length \(16\) must equal model\.seq_length \(32\)"):
        build_dataloader(section_for(prefix, tmp_path), local_batch_size=1, seq_length=32)


def test_too_small_for_one_step(tmp_path):
    prefix = write_docs(tmp_path / "tiny", [[1, 2, 3, 0]] * 5)
    section = typed(loader_section({"seq_length": 4, "train_data_path": [prefix]}))
    with pytest.raises(DataError, match="fewer than one step"):
        build_dataloader(section, local_batch_size=8)


def test_epoch_boundary_wraps_without_gaps(prefix, tmp_path):
    loader = build_dataloader(section_for(prefix, tmp_path), local_batch_size=5)
    n = len(loader)
    seen = [k for s in range(2 * n) for k in loader.indices_of_step(s)]
    assert seen == list(range(n * 5)) * 2
    np.testing.assert_array_equal(np.asarray(seen[: n * 5]), np.arange(n * 5))


ALL_COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids"]


@pytest.mark.parametrize(
    ("config", "extra_column", "phase"),
    [
        (
            {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True},
            "attention_mask",
            "train",
        ),
        ({"create_compressed_eod_mask": True, "eod_pad_length": 6}, "actual_seq_len", "train"),
        ({"add_extra_token_to_sequence": False, "pad": 7, "eod_mask_loss": True}, None, "train"),
        ({"drop_last_partial_validation_sequence": False, "reset_position_ids": True}, None, "valid"),
    ],
)
def test_batched_rows_equal_dataset_samples(prefix, tmp_path, config, extra_column, phase):
    """The loader writes rows straight into the batch; they must equal dataset[k] column by column."""
    second = write_docs(tmp_path / "second", random_docs(12, 50, vocab=300))
    cfg = {
        "seq_length": 16,
        "eod": 0,
        "data_path": ["0.6", prefix, "0.4", second],
        "split": "70,30,0",
        "path_to_cache": str(tmp_path / "cache"),
        "create_attention_mask": extra_column == "attention_mask",
        **config,
    }
    columns = ALL_COLUMNS + ([extra_column] if extra_column else [])
    section = typed(loader_section(cfg, sizes=[300, 64, 0], columns=columns, drop_remainder=False))
    dataset, _ = build_dataset(section, phase=phase)
    loader = build_dataloader(section, local_batch_size=7, phase=phase)
    steps = list(loader) if phase == "valid" else take(loader, len(loader))
    assert any(k is None for s in range(len(loader)) for k in loader.indices_of_step(s))
    for step, batch in enumerate(steps):
        for row, k in enumerate(loader.indices_of_step(step)):
            sample = dataset[k]
            for name in columns:
                want = sample[name] + (16 * row if name == "actual_seq_len" else 0)
                np.testing.assert_array_equal(
                    batch[name][row].numpy(), want, err_msg=f"{name} step {step} row {row}"
                )


def test_validate_section_needs_no_files(tmp_path):
    section = loader_section({"seq_length": 16, "train_data_path": [str(tmp_path / "not-built-yet")]})
    loader = typed(section).dataloader.typed
    loader.check_against_model(16, 100)
    with pytest.raises(ConfigError, match=r"config\.seq_length \(16\) must equal model\.seq_length \(8\)"):
        loader.check_against_model(8, None)
    with pytest.raises(ConfigError, match=r"column_names .*create_attention_mask is false"):
        typed(loader_section({"seq_length": 16, "train_data_path": ["x"]}, columns=["attention_mask"]))
    with pytest.raises(ConfigError, match=r"train_dataset\.num_parallel_workers must be an integer >= 0"):
        typed({**section, "num_parallel_workers": -2})
    with pytest.raises(ConfigError, match="MindDataset"):
        typed({"dataloader": {"type": "MindDataset"}})


@pytest.mark.parametrize(
    "wrong", [{"dataloader": {"type": "BlendedMegatronDatasetDataLoader"}}, None, "train"]
)
def test_builders_take_only_the_typed_section(wrong):
    """A mapping (or anything but the typed section) is a TypeError naming what to pass: a builder
    validates nothing itself."""
    with pytest.raises(
        TypeError, match=r"build_dataloader takes the typed train_dataset section .*validate_section"
    ):
        build_dataloader(wrong, local_batch_size=1)
    with pytest.raises(TypeError, match=r"build_dataset takes the typed train_dataset section"):
        build_dataset(wrong)


def test_keys_the_megatron_loader_does_not_read_are_warned_about_at_load(base_config):
    from lmforge.config import load_config

    base_config["train_dataset"]["dataloader"].update({"num_shards": 4, "seed_offset": None})
    base_config["train_dataset"]["dataloader"]["config"]["num_dataset_builder_threads"] = 4
    warnings = load_config(base_config).warnings
    assert any(
        "train_dataset.dataloader.num_shards, train_dataset.dataloader.seed_offset are not used by "
        "BlendedMegatronDatasetDataLoader" in w
        for w in warnings
    ), warnings
    assert any("config.num_dataset_builder_threads has no effect" in w for w in warnings), warnings


def test_a_cache_directory_the_user_named_that_cannot_be_written_is_an_error(prefix, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    section = section_for(prefix, tmp_path, config={"path_to_cache": str(blocker / "cache")})
    with pytest.raises(DataError, match=r"train_dataset\.dataloader\.config\.path_to_cache: cannot write"):
        build_dataset(section)


def test_the_default_cache_directory_falls_back_to_memory_when_it_cannot_be_written(tmp_path, caplog):
    # The data's own directory holds a file named "cache": the default <data dir>/cache/... cannot be made.
    prefix = write_docs(tmp_path / "corpus", random_docs(11, 120, vocab=300))
    (tmp_path / "cache").write_text("not a directory")
    section = typed(loader_section({"seq_length": 16, "eod": 0, "train_data_path": [prefix]}))
    dataset, _ = build_dataset(section)
    assert len(dataset) > 0
    assert "keeping it in memory" in caplog.text
