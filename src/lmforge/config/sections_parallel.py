"""Sections about distribution and memory: parallelism, recompute, recompute_comm, swap."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import model_validator

from lmforge.config.base import Float, Section, check_one_of
from lmforge.config.layer_spec import parse_layer_specs

# --------------------------------------------------------------------------------------------------
# parallelism

# ZeRO-1, ZeRO-2, ZeRO-3 (docs/compatibility.md: ZeRO-1 runs as ZeRO-2, FSDP2 always shards gradients)
SHARD_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
# The longest wait for a collective or the start-up (parallelism.process_group_timeout, lmforge env
# --timeout): a week, longer than any real one; .inf or 1e300 overflow timedelta.
MAX_WAIT_S = 7 * 24 * 3600.0
RESHARD_POLICIES = ("always", "never", "default")
CP_METHODS = ("colossal", "ulysses", "hybrid")
PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
P2P_TRANSPORTS = ("auto", "plain")
DISPATCHERS = ("alltoall", "alltoall_deredundancy")
_PP_CHUNK = re.compile(r"^\s*\d+\s*(-\s*\d+\s*)?$")


class ParallelismConfig(Section):
    data_parallel_shard: int = -1
    data_parallel_shard_strategy: str = "optim_grads_params"
    reshard_after_forward_policy: str = "default"
    cpu_offload: bool = False
    disable_gradient_division: bool = True
    dense_fsdp_shard_size: int | None = None
    tensor_parallel: int = 1
    context_parallel: int = 1
    context_parallel_method: str = "colossal"
    context_parallel_async: bool = False
    ulysses_degree_in_cp: int | None = None
    context_parallel_mask_type: str = "causal"
    pipeline_parallel: int = 1
    # The original's class default is "auto" (the spec's table says None); null means the same.
    pipeline_parallel_layers_per_stage: str | list[Any] | None = "auto"
    pipeline_parallel_schedule: str = "1f1b"
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_interleave_num: int = 1
    pipeline_parallel_overlap_p2p: bool = False
    pipeline_parallel_overlap_b_f: bool = False
    pipeline_parallel_enable_dxdw_split: bool = False
    pipeline_parallel_p2p_transport: str = "plain"
    # The spec: "enabling TP enables SP automatically; turning it off is not supported". lmforge sets it
    # whenever tensor_parallel > 1 instead of refusing a file that omits it (the original's master does).
    sequence_parallel: bool = False
    enable_mc2: bool = False
    enable_loss_parallel: bool = False
    expert_parallel: int = 1
    npu_nums_per_device: int = 8
    moe_token_dispatcher_type: str = "alltoall"
    expert_parallel_async_d2h: bool = False
    expert_parallel_use_safe_tokens: bool = True
    # lmforge extension (docs/parallel.md "Timeouts and hangs"): seconds a collective, the start-up
    # rendezvous or one training phase may wait for the slowest rank before the job fails.
    process_group_timeout: Float = 1800.0

    @model_validator(mode="before")
    @classmethod
    def _sequence_parallel_follows_tp(cls, data: Any) -> Any:
        if isinstance(data, dict):
            tp = data.get("tensor_parallel", 1)
            if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1:
                data = {**data, "sequence_parallel": True}
        return data

    @model_validator(mode="after")
    def _check(self) -> ParallelismConfig:
        p = "parallelism"
        if self.data_parallel_shard == 0 or self.data_parallel_shard < -1:
            raise ValueError(
                f"{p}.data_parallel_shard must be -1 (shard over every data-parallel rank) or a positive "
                f"integer, got {self.data_parallel_shard}"
            )
        for name in (
            "tensor_parallel",
            "context_parallel",
            "pipeline_parallel",
            "pipeline_parallel_interleave_num",
            "pipeline_parallel_microbatch_size",
            "expert_parallel",
            "npu_nums_per_device",
            "dense_fsdp_shard_size",
            "ulysses_degree_in_cp",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{p}.{name} must be a positive integer (1 disables it), got {value}")
        check_one_of(self.data_parallel_shard_strategy, f"{p}.data_parallel_shard_strategy", SHARD_STRATEGIES)
        check_one_of(self.reshard_after_forward_policy, f"{p}.reshard_after_forward_policy", RESHARD_POLICIES)
        check_one_of(self.context_parallel_method, f"{p}.context_parallel_method", CP_METHODS)
        check_one_of(self.pipeline_parallel_schedule, f"{p}.pipeline_parallel_schedule", PP_SCHEDULES)
        check_one_of(
            self.pipeline_parallel_p2p_transport, f"{p}.pipeline_parallel_p2p_transport", P2P_TRANSPORTS
        )
        check_one_of(self.moe_token_dispatcher_type, f"{p}.moe_token_dispatcher_type", DISPATCHERS)
        if self.moe_token_dispatcher_type == "alltoall_deredundancy" and (
            self.expert_parallel < self.npu_nums_per_device
        ):
            raise ValueError(
                f"{p}.expert_parallel must be greater than or equal to npu_nums_per_device when using "
                f"'alltoall_deredundancy', but got expert_parallel={self.expert_parallel} < "
                f"npu_nums_per_device={self.npu_nums_per_device}."
            )
        if self.context_parallel_method == "hybrid" and self.context_parallel > 1:
            u = self.ulysses_degree_in_cp
            if u is None:
                raise ValueError(
                    f"{p}.ulysses_degree_in_cp is required when context_parallel_method is 'hybrid' "
                    f"(a divisor of context_parallel={self.context_parallel})"
                )
            if self.context_parallel % u != 0:
                raise ValueError(
                    f"{p}.ulysses_degree_in_cp ({u}) must divide context_parallel ({self.context_parallel})"
                )
        self._check_layers_per_stage()
        if not (math.isfinite(self.process_group_timeout) and 0 < self.process_group_timeout <= MAX_WAIT_S):
            # .inf or 1e300 passed here and were an OverflowError traceback from timedelta at a torchrun start-up.
            raise ValueError(
                f"{p}.process_group_timeout must be a positive, finite number of seconds (default 1800, at most "
                f"{MAX_WAIT_S:g}: a week), got {self.process_group_timeout}"
            )
        return self

    def _check_layers_per_stage(self) -> None:
        path = "parallelism.pipeline_parallel_layers_per_stage"
        spec = self.pipeline_parallel_layers_per_stage
        if spec is None or spec == "auto":
            return
        if isinstance(spec, str):
            raise ValueError(
                f"{path} must be 'auto' or a list of strings (one per pipeline stage), got {spec!r}"
            )
        pp, chunks = self.pipeline_parallel, self.pipeline_parallel_interleave_num
        if len(spec) != pp:
            raise ValueError(
                f"{path} must have one entry per pipeline stage (pipeline_parallel={pp}), got {len(spec)}"
            )
        for i, entry in enumerate(spec):
            if not isinstance(entry, str):
                raise ValueError(
                    f"{path}[{i}] must be a string of {chunks} comma-separated layer ranges such as '0-3' "
                    f"or '4', got {entry!r}"
                )
            parts = entry.split(",")
            if len(parts) != chunks:
                raise ValueError(
                    f"{path}[{i}] must hold pipeline_parallel_interleave_num={chunks} comma-separated "
                    f"ranges, got {entry!r}"
                )
            for part in parts:
                if not _PP_CHUNK.match(part):
                    raise ValueError(
                        f"{path}[{i}]: invalid layer range {part.strip()!r}; expected format is "
                        "'start-end' or 'single_layer'"
                    )
                bounds = [int(x) for x in part.split("-")]
                if bounds[0] > bounds[-1]:
                    raise ValueError(
                        f"{path}[{i}]: invalid layer range {part.strip()!r}: layer_start must be less than "
                        "or equal to layer_end"
                    )


# --------------------------------------------------------------------------------------------------
# recompute, recompute_comm, swap

RECOMPUTE_MODES = ("None", "full", "select")


def _check_select_module(value: Any, path: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(
            f"{path} must be a mapping (module name pattern -> list of layer specs), got {type(value).__name__}"
        )
    for key, specs in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{path}: every key must be a non-empty module name pattern, got {key!r}")
        parse_layer_specs(specs, f"{path}[{key!r}]")


class RecomputeConfig(Section):
    mode: str = "None"
    full_recompute_layer: list[Any] | None = None
    select_module: dict[Any, Any] | None = None
    exclude_op: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_mode_is_none(cls, data: Any) -> Any:
        # The mode is the *string* "None"; an explicit YAML null means the same thing.
        if isinstance(data, dict) and "mode" in data and data["mode"] is None:
            data = {**data, "mode": "None"}
        return data

    @model_validator(mode="after")
    def _check(self) -> RecomputeConfig:
        if self.mode not in RECOMPUTE_MODES:  # ours, then the original's message
            raise ValueError(
                f"recompute.mode must be one of 'None', 'full', 'select'; got {self.mode!r} (RecomputeConfig.mode "
                f"must be 'None', 'full', or 'select', got {self.mode})"
            )
        if self.mode == "full" and not self.full_recompute_layer:
            raise ValueError(
                "recompute.full_recompute_layer is required when recompute.mode is 'full' (mode is 'full' "
                "but full_recompute_layer is missing or empty); e.g. full_recompute_layer: ['0-3']"
            )
        if self.mode == "select" and not self.select_module:
            raise ValueError(
                "recompute.select_module is required when recompute.mode is 'select' (mode is 'select' but "
                "select_module is missing or empty); e.g. select_module: {'mlp': ['0-3']}"
            )
        if self.full_recompute_layer is not None:
            parse_layer_specs(self.full_recompute_layer, "recompute.full_recompute_layer")
        if self.select_module is not None:
            _check_select_module(self.select_module, "recompute.select_module")
        return self


class RecomputeCommConfig(Section):
    enable: bool = False
    select_module: dict[Any, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> RecomputeCommConfig:
        if self.enable and not self.select_module:
            raise ValueError(
                "recompute_comm.select_module is required when recompute_comm.enable is True (enable is "
                "True but select_module is missing or empty); e.g. select_module: {'attention.qkv': ['0-3']}"
            )
        if self.select_module is not None:
            _check_select_module(self.select_module, "recompute_comm.select_module")
        return self


def _swap_entries(value: Any, path: str, needs_op_name: bool) -> list[dict[str, Any]]:
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list):
        raise ValueError(f"{path} must be a list of mappings, got {type(value).__name__}")
    allowed = {"op_name", "layers"} if needs_op_name else {"layers"}
    for i, entry in enumerate(entries):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping such as {{layers: ['0-1']}}, got {entry!r}")
        unknown = sorted(str(k) for k in entry if k not in allowed)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; valid keys are {sorted(allowed)}")
        if "layers" not in entry:
            raise ValueError(f"{where}.layers is required (a list of layer specs such as ['0-1'])")
        if needs_op_name and (not isinstance(entry.get("op_name"), str) or not entry["op_name"]):
            raise ValueError(f"{where}.op_name is required (a module name or regex such as 'attention')")
        parse_layer_specs(entry["layers"], f"{where}.layers")
    return entries


class SwapConfig(Section):
    enable: bool = False
    default_prefetch: int = 1
    layer_swap: list[Any] | dict[Any, Any] | None = None
    op_swap: list[Any] | dict[Any, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> SwapConfig:
        if self.default_prefetch < 1:
            raise ValueError(
                f"swap.default_prefetch must be in [1, num_layers - 1], got {self.default_prefetch}"
            )
        if self.layer_swap is not None:
            _swap_entries(self.layer_swap, "swap.layer_swap", needs_op_name=False)
        if self.op_swap is not None:
            _swap_entries(self.op_swap, "swap.op_swap", needs_op_name=True)
        return self
