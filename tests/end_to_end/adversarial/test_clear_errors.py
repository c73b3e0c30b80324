"""Class 4: hostile or unlucky input gets exit 2 and a message naming the key or path, not a traceback."""

from __future__ import annotations

import errno
import time

import pytest

from lmforge.train.checkpoint import manager as ckpt_mod
from lmforge.train.checkpoint import read_tracker

from .conftest import snapshot

ITER = "iteration_00000002"


def _no_traceback(code, err):
    assert code == 2, err
    assert "Traceback" not in err


# -- hostile YAML ---------------------------------------------------------------------------------


def _bomb(levels=9):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


YAMLS = {
    "alias-bomb": (_bomb(), "alias-expansion bomb"),
    "deep-sequences": ("x: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    "deep-mappings": ("x: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nested too deeply"),
    "recursive-alias": ("a: &a [1, *a]\n", "refers to the node that contains it"),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["check", "train", "lr"])
@pytest.mark.parametrize("kind", list(YAMLS))
def test_hostile_yaml_is_refused_quickly(cli, tmp_path, kind, command):
    text, needle = YAMLS[kind]
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    start = time.perf_counter()
    code, _, err = cli(command, "--config", path)
    _no_traceback(code, err)
    assert needle in err and str(path) in err
    assert time.perf_counter() - start < 10


# -- absurd model dimensions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    ["model.hidden_size=1048576000", "model.vocab_size=100000000000", "model.num_hidden_layers=100000000"],
)
def test_absurd_model_dimensions_are_refused_before_allocating(run_copy, cli, override):
    start = time.perf_counter()
    code, _, err = cli(
        "train", "--config", run_copy / "train.yaml", "--set", override, "--set", "training.steps=1"
    )
    _no_traceback(code, err)
    assert "refuses before allocating" in err and "GiB of weights alone" in err
    assert time.perf_counter() - start < 10
    assert read_tracker(run_copy / "ckpt") == 2


# -- output paths ---------------------------------------------------------------------------------


def test_output_dir_that_is_a_file(run_copy, cli, tmp_path):
    (tmp_path / "out").write_text("a file")
    code, _, err = cli(
        "train", "--config", run_copy / "train.yaml", "--set", f"output_dir={tmp_path / 'out'}"
    )
    _no_traceback(code, err)
    assert "output_dir" in err and "is a file" in err and (tmp_path / "out").read_text() == "a file"


def test_save_path_under_a_file(run_copy, cli, tmp_path):
    (tmp_path / "f").write_text("a file")
    code, _, err = cli(
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        f"checkpoint.save_path={tmp_path / 'f' / 'ckpt'}",
        "--set",
        f"output_dir={tmp_path / 'o'}",
    )
    _no_traceback(code, err)
    assert "is a file, not a directory" in err


def test_read_only_output_dir(run_copy, cli, tmp_path, monkeypatch):
    import os

    from lmforge.utils import atomic

    target = tmp_path / "ro"
    target.mkdir()
    real = os.access
    monkeypatch.setattr(
        atomic.os, "access", lambda p, mode: False if str(p) == str(target) else real(p, mode)
    )
    code, _, err = cli("train", "--config", run_copy / "train.yaml", "--set", f"output_dir={target / 'run'}")
    _no_traceback(code, err)
    assert "is not writable" in err


def test_disk_full_during_a_save(run_copy, cli, monkeypatch):
    before = snapshot(run_copy / "ckpt")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "_write_json", full)
    code, _, err = cli(
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        f"checkpoint.load_path={run_copy / 'ckpt'}",
        "--set",
        "training.steps=4",
    )
    _no_traceback(code, err)
    assert "No space left on device" in err and "iteration 2) is intact" in err
    assert snapshot(run_copy / "ckpt") == before and read_tracker(run_copy / "ckpt") == 2
    assert not any(p.name.endswith(".partial") for p in (run_copy / "ckpt").iterdir())


def test_os_error_outside_lmforge_code_is_a_message(run_copy, cli, monkeypatch, tmp_path):
    from lmforge.models import hf_io

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "hf" / "model.safetensors"))

    monkeypatch.setattr(hf_io, "write_sharded", read_only)
    code, _, err = cli("convert", "--from", run_copy / "ckpt", "--to-hf", tmp_path / "hf")
    _no_traceback(code, err)
    assert "read-only" in err and "model.safetensors" in err and not (tmp_path / "hf").exists()


# -- bad command-line values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--temperature", "-1"], "--temperature must be a finite number"),
        (["--temperature", "inf"], "--temperature must be a finite number"),
        (["--top-k", "-3"], "--top-k must be >= 0"),
        # was "ValueError: Overflow when unpacking long long" from torch.manual_seed
        (["--seed", str(2**70)], "--seed must be an integer in [0, 2**64 - 1]"),
        # was silently ignored: --prompt mode applies no template
        (["--chat-template", "t.jinja"], "--chat-template goes with chat mode"),
        # were silently unused: greedy decoding takes the most likely token whatever they say
        (["--temperature", "0", "--top-p", "0.9"], "--top-p filter the tokens"),
        (["--temperature", "0", "--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p filter the tokens"),
    ],
    ids=[
        "max-new-tokens",
        "temperature-nan",
        "temperature-negative",
        "temperature-inf",
        "top-k",
        "seed",
        "template",
        "top-p-with-greedy",
        "top-k-and-top-p-with-greedy",
    ],
)
def test_bad_generate_values(run_copy, cli, args, needle):
    code, _, err = cli("generate", "--checkpoint", run_copy / "ckpt", "--prompt", "t1", *args)
    _no_traceback(code, err)
    assert needle in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-o", "{tmp}"], "no extension"),
        (["-o", "{tmp}/plot.xyz"], ".xyz is not one of"),
        (["-o", "{tmp}/f/plot.png"], "f' is a file"),
        (["-o", "{tmp}/lr.png", "--csv", "{tmp}"], "--csv"),
    ],
    ids=["output-is-a-directory", "unknown-format", "output-under-a-file", "csv-is-a-directory"],
)
def test_bad_lr_outputs(run_copy, cli, tmp_path, args, needle):
    (tmp_path / "f").write_text("a file")
    code, _, err = cli("lr", "--config", run_copy / "train.yaml", *[a.format(tmp=tmp_path) for a in args])
    _no_traceback(code, err)
    assert needle in err and (tmp_path / "f").read_text() == "a file"


def test_lr_outputs_in_directories_still_to_create(run_copy, cli, tmp_path):
    # Before: both passed the output checks ("a path to create"), then failed with "no such file or
    # directory (.../.lr.png.tmp-PID)", naming a temporary file.
    plot, table = tmp_path / "new" / "plots" / "lr.png", tmp_path / "other" / "lr.csv"
    code, out, err = cli("lr", "--config", run_copy / "train.yaml", "-o", plot, "--csv", table)
    assert code == 0, err
    assert plot.is_file() and table.read_text().startswith("step,lr")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 must be below WORLD_SIZE=2"),
    ],
    ids=["not-a-number", "zero", "rank-too-large"],
)
def test_bad_torchrun_environment(run_copy, cli, monkeypatch, env, needle):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = cli("train", "--config", run_copy / "train.yaml", "--set", "training.steps=3")
    _no_traceback(code, err)
    assert needle in err


def test_debug_shows_the_traceback(cli, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    code, _, err = cli("--debug", "check", "--config", path)
    assert code == 2 and "Traceback" in err and "alias-expansion bomb" in err


def test_demo_output_that_is_a_file(cli, tmp_path):
    (tmp_path / "f").write_text("a file")
    code, _, err = cli("data", "demo", "--output", tmp_path / "f")
    _no_traceback(code, err)
    assert "--output" in err and "is a file" in err and (tmp_path / "f").read_text() == "a file"


def test_missing_preprocess_input(run_copy, cli, tmp_path):
    code, _, err = cli(
        "data",
        "preprocess",
        "--input",
        tmp_path / "nope.jsonl",
        "--tokenizer",
        run_copy / "data" / "tokenizer.json",
        "--output-prefix",
        tmp_path / "x",
    )
    _no_traceback(code, err)
    assert "no such file" in err


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (f"training.seed={2**64}", "training.seed must be an integer in [0, 2**64 - 1]"),
        ("training.seed=-1", "training.seed must be an integer in [0, 2**64 - 1]"),
        (
            f"train_dataset.dataloader.config.seed={2**32}",
            "train_dataset.dataloader.config.seed must be <= 4294967295",
        ),
    ],
    ids=["seed-past-torch", "seed-negative", "data-seed-past-numpy"],
)
def test_seeds_outside_the_generators_range_are_refused_by_check(cli, override, needle):
    # Before: check passed them, and train died after building the model with a traceback from
    # torch.manual_seed (overflow), numpy's default_rng (a negative seed: the text loader's shuffle) or
    # numpy's RandomState (the Megatron sample order past 2**32 - 1).
    code, _, err = cli("check", "--config", "configs/demo.yaml", "--set", override)
    _no_traceback(code, err)
    assert needle in err, err


def _tokenizer_past_the_model(path):
    """A word-level tokenizer whose ids run past the tiny model's 64: "w80" is id 80."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(100)}
    vocab["<|endoftext|>"] = 100
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_generate_with_another_models_tokenizer(run_copy, cli, tmp_path):
    # Before: "IndexError: index out of range in self" from the embedding lookup.
    tok = _tokenizer_past_the_model(tmp_path / "tokenizer.json")
    argv = ["generate", "--checkpoint", run_copy / "ckpt", "--tokenizer", tok, "--device", "cpu"]
    code, _, err = cli(*argv, "--prompt", "w1 w80")
    _no_traceback(code, err)
    assert "the prompt encodes to token id 80, but the model has 64 token ids" in err and str(tok) in err


def test_a_config_path_that_is_a_dangling_link_or_a_loop_says_so(cli, tmp_path):
    # Before: "(does not exist)" for a path that `ls` shows.
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    for name in ("a.yaml", "dangling.yaml"):
        code, _, err = cli("check", "--config", tmp_path / name)
        _no_traceback(code, err)
        assert "is a symbolic link to nothing" in err and str(tmp_path / name) in err, err


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["generate", "--checkpoint", "{d}", "--prompt", "t1"], "--checkpoint"),
        (["eval", "--checkpoint", "{d}"], "--checkpoint"),
        (["convert", "--to-hf", "{out}", "--from", "{d}"], "--from"),
        (["checkpoint", "inspect", "{d}"], "DIR"),
    ],
    ids=["generate", "eval", "convert", "inspect"],
)
def test_a_directory_that_is_no_checkpoint_is_named_by_the_option_given(cli, tmp_path, argv, name):
    # Before: every command said "checkpoint.load_path '...' is not a checkpoint", a YAML key they do not read.
    d = tmp_path / "not_a_checkpoint"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    code, _, err = cli(*[a.format(d=d, out=tmp_path / "out") for a in argv])
    _no_traceback(code, err)
    assert f"{name} '{d}' is not a checkpoint" in err and "checkpoint.load_path" not in err, err
