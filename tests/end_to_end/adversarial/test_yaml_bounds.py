"""YAML files and their alias expansion are bounded (documented limits), refused fast and clearly, and
the pure-Python parser only ever sees a bounded document."""

from __future__ import annotations

import time

import pytest

from lmforge.config.yaml_io import MAX_EXPANDED_BYTES, MAX_EXPANDED_NODES, MAX_YAML_BYTES, parse_yaml_text

# Not a speed claim: a guard that separates "refused before parsing" (milliseconds here) from what these
# files did before the bounds (minutes at 2 GB of memory), generous for any loaded machine.
FAST_S = 10.0


def _refused_fast(cli, path, needle):
    start = time.perf_counter()
    code, _, err = cli("check", "--config", path)
    elapsed = time.perf_counter() - start
    assert code == 2 and needle in err and str(path) in err and "Traceback" not in err
    assert elapsed < FAST_S, f"took {elapsed:.2f} s"


def test_one_megabyte_aliased_two_thousand_times_is_refused_fast(cli, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text('big: &a "' + "x" * 1_000_000 + '"\nlist: [' + ", ".join(["*a"] * 2000) + "]\n")
    _refused_fast(cli, path, f"is larger than {MAX_YAML_BYTES:,} bytes")


def test_a_large_string_aliased_many_times_under_the_file_limit_is_refused_fast(cli, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text('big: &a "' + "x" * 100_000 + '"\nlist: [' + ", ".join(["*a"] * 2000) + "]\n")
    assert path.stat().st_size < MAX_YAML_BYTES
    _refused_fast(cli, path, f"expands to more than {MAX_EXPANDED_BYTES:,} characters of text")


def test_a_fifty_megabyte_file_is_refused_without_reading_it(cli, tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.truncate(50 << 20)  # sparse: 50 MB of zeros
    _refused_fast(cli, path, "is larger than")


def test_many_small_values_are_refused_before_the_slow_parser(cli, tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text("model: [" + ",".join("1" for _ in range(MAX_EXPANDED_NODES + 10)) + "]\n")
    assert path.stat().st_size < MAX_YAML_BYTES
    _refused_fast(cli, path, f"expands to more than {MAX_EXPANDED_NODES:,} values")


@pytest.mark.parametrize("n", [MAX_EXPANDED_NODES // 4])
def test_a_document_within_the_bounds_parses_to_the_same_data(n):
    text = "a: &x {k: [1, 2.5e-3, two]}\nb: *x\nlist: [" + ",".join(str(i) for i in range(n)) + "]\n"
    data = parse_yaml_text(text)
    assert data["a"] == data["b"] == {"k": [1, 0.0025, "two"]} and data["list"] == list(range(n))
