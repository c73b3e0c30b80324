"""Which decoder layers each pipeline stage holds (``pipeline_parallel_layers_per_stage``).

``"auto"`` (or null) splits ``num_layers`` evenly over ``pp × interleave`` virtual stages. Otherwise the
value is one string per pipeline rank, each holding ``interleave`` comma-separated chunks ``"a-b"``
(inclusive) or ``"a"``; chunk ``c`` of rank ``r`` is virtual stage ``c·pp + r`` (mindformers.md §1.3).
Unlike the original, the chunks must cover every layer exactly once, in order along the stages, since a
layer left out or run twice would silently train a different model.
"""

from __future__ import annotations

import re
from typing import Any

from lmforge.errors import ConfigError

_KEY = "parallelism.pipeline_parallel_layers_per_stage"
_CHUNK = re.compile(r"^\s*(-?\d+)\s*(?:-\s*(-?\d+)\s*)?$")


def _parse_chunk(text: str, rank: int) -> range:
    m = _CHUNK.match(text)
    if not m:
        raise ConfigError(
            f"{_KEY}[{rank}]: invalid layer range format: {text!r}. Layer IDs must be integers; expected "
            "format is 'start-end' or 'single_layer' (e.g. '0-3' or '5'), chunks separated by commas."
        )
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) is not None else start
    if start < 0:
        raise ConfigError(f"{_KEY}[{rank}]: layer ids must be non-negative, got {text!r}.")
    if start > end:
        raise ConfigError(
            f"{_KEY}[{rank}]: invalid layer range {text!r}: layer_start must be less than or equal to layer_end."
        )
    return range(start, end + 1)


def stage_layers(value: Any, *, num_layers: int, pp: int, interleave: int = 1) -> list[list[int]]:
    """Layer ids of every virtual stage, indexed by stage id (``len == pp × interleave``)."""
    if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_interleave_num must be a positive integer, got {interleave!r}."
        )
    n_stages = pp * interleave
    if value is None or value == "auto":
        if num_layers % n_stages:
            raise ConfigError(
                f"Number of layers ({num_layers}) is not divisible by total stages ({n_stages}). Please "
                f"configure the model distribution via 'pipeline_parallel_layers_per_stage' ({_KEY}: one "
                f"string per pipeline rank such as '0-3', or 'auto')."
            )
        per = num_layers // n_stages
        return [list(range(s * per, (s + 1) * per)) for s in range(n_stages)]
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{_KEY} must be 'auto' or a list with one string per pipeline rank (e.g. ['0-3', '4-7']), "
            f"got {value!r}."
        )
    if len(value) != pp:
        raise ConfigError(
            f"{_KEY} has {len(value)} entries but parallelism.pipeline_parallel is {pp}: give one string per "
            "pipeline rank."
        )
    stages: list[list[int]] = [[] for _ in range(n_stages)]
    for rank, entry in enumerate(value):
        if isinstance(entry, bool) or not isinstance(entry, (str, int)):
            raise ConfigError(
                f"{_KEY}[{rank}] must be a string like '0-3' or '0-1,8-9' (a list of lists is not supported by "
                f"the original either), got {entry!r}."
            )
        chunks = str(entry).split(",")
        if len(chunks) != interleave:
            raise ConfigError(
                f"{_KEY}[{rank}] = {entry!r} has {len(chunks)} chunk(s) but "
                f"parallelism.pipeline_parallel_interleave_num is {interleave}: each rank needs one "
                "comma-separated chunk per model chunk."
            )
        for c, text in enumerate(chunks):
            stages[c * pp + rank] = list(_parse_chunk(text, rank))
    flat = [layer for stage in stages for layer in stage]
    if flat != list(range(num_layers)):
        raise ConfigError(
            f"{_KEY} must assign each of the {num_layers} decoder layers to exactly one stage, in order along "
            f"the virtual stages (chunk c of rank r is stage c×pp+r); got stages {stages}."
        )
    return stages


def stages_of_rank(pp_rank: int, pp: int, interleave: int) -> list[int]:
    """Virtual stage ids held by ``pp_rank`` (looped placement: chunk c is stage c·pp + rank)."""
    return [c * pp + pp_rank for c in range(interleave)]
