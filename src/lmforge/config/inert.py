"""Fields that lmforge accepts (so the original's files load) but that have no effect here.

DESIGN.md §2.5: never silently ignore a setting. Each entry says why the field does nothing; a
warning is emitted when a file sets it to anything but its default, or, for whole sections that do
nothing, when the file writes the section at all. ``docs/compatibility.md`` lists the same fields.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.config.base import Section
    from lmforge.config.schema import ParallelismConfig, TrainConfig

# dotted key -> why it has no effect in lmforge
INERT_FIELDS: dict[str, str] = {
    "context.mode": "MindSpore's execution mode; lmforge always runs eager PyTorch (the PyNative equivalent)",
    "context.max_device_memory": "a MindSpore device-memory cap; use PYTORCH_CUDA_ALLOC_CONF or "
    "torch.cuda.set_per_process_memory_fraction instead",
    "context.device_target": "MindSpore's device choice; lmforge uses CUDA when available, otherwise the CPU",
    "checkpoint.load_worker_number": "declared but never read by the original either",
    "checkpoint.save_global_layout_cache": "a MindSpore layout cache; torch.distributed.checkpoint needs none",
    "checkpoint.reshard_worker_num": "resharding on load is done by torch.distributed.checkpoint itself",
    "parallelism.npu_nums_per_device": "only used by the alltoall_deredundancy rule; lmforge's MoE dispatch "
    "does not deduplicate per device",
    "parallelism.enable_mc2": "Ascend's fused matmul+communication kernels (MC2) do not exist in PyTorch",
    "parallelism.expert_parallel_async_d2h": "an Ascend device-to-host copy option",
    "parallelism.pipeline_parallel_microbatch_size": "set at run time to the number of gradient-accumulation "
    "steps (as the original does)",
    "parallelism.pipeline_parallel_p2p_transport": "torch.distributed.pipelining chooses its own transport",
    "parallelism.pipeline_parallel_overlap_p2p": "P2P/compute overlap is left to torch.distributed.pipelining",
    "parallelism.pipeline_parallel_overlap_b_f": "backward/forward overlap is left to "
    "torch.distributed.pipelining",
    "parallelism.pipeline_parallel_enable_dxdw_split": "the dx/dw split (zero-bubble) schedules are not wired "
    "to this switch",
    "parallelism.expert_parallel_use_safe_tokens": "an Ascend dispatch safety switch; the all-to-all here is "
    "exact",
    "parallelism.enable_loss_parallel": "under tp the loss is vocabulary-parallel whenever "
    "model.loss_chunk_size > 0 (the default) and computed from gathered logits at 0, whatever this key says "
    "(same value)",
    "train_dataset.numa_enable": "NUMA binding of MindSpore's data pipeline",
    "profiler.mstx": "Ascend's lightweight marker collection; use torch.profiler record_function ranges",
    # optimizer.*: the optimizer's keys are its type's schema's (lmforge.optim.specs), which warns about
    # the ones that change nothing (accumulate_allreduce_grads_in_fp32: false, kernel choices) itself.
    # The model section's keys are its family's (models/common/config_keys.py), not ModelConfig's: these
    # warn whenever the file writes them. ep_size is a key of DeepSeek's own config.json.
    "model.use_attn_mask_compression": "the model accepts attention_mask or actual_seq_len; the data "
    "pipeline decides which it sends",
    "model.use_eod_attn_mask_compression": "the model accepts attention_mask or actual_seq_len; the data "
    "pipeline decides which it sends",
    "model.use_pad_tokens": "routing is dropless",
    "model.moe_grouped_gemm": "experts are always computed batched",
    "model.moe_token_dispatcher_type": "the parallelism section chooses the dispatcher",
    "model.moe_token_drop_policy": "routing is dropless",
    "model.moe_router_fusion": "the router is plain PyTorch; there is no fused kernel to choose",
    "model.moe_permute_fusion": "token permutation is plain PyTorch; there is no fused kernel to choose",
    "model.mla_qkv_concat": "a weight layout choice; lmforge keeps the q and kv projections apart",
    "model.ep_size": "the parallelism section's expert_parallel sets the expert-parallel degree",
}

# Sections that lmforge accepts but does not implement yet: a warning whenever the file writes them.
INERT_SECTIONS: dict[str, str] = {}


def _lookup(raw: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _unknown_top_level(raw: Mapping[str, Any], sections: Mapping[str, Any]) -> list[str]:
    # The top level passes unknown keys through (allow_extra), so a misspelt section name would be
    # ignored without a word; say so, with the closest section name.
    # output_dir: lmforge's run directory; eval_*: validation during training (lmforge.train.callbacks.validation),
    # which reads eval_dataset only when it evaluates.
    known = [*sections, "output_dir", "eval_interval", "eval_steps", "eval_dataset"]
    out = []
    if raw.get("eval_dataset") is not None and not raw.get("eval_interval"):
        # (null: no eval_dataset, as a checkpoint's config.yaml writes it back)
        out.append(
            "eval_dataset is set but eval_interval is 0: training does not evaluate on it (lmforge eval "
            "--checkpoint DIR does); set eval_interval: N to validate every N steps"
        )
    for key in raw:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"top-level key {key!r} is not a section lmforge reads; it is passed through unused{hint}")
    return out


def collect_warnings(raw: Mapping[str, Any], cfg: TrainConfig) -> list[str]:
    """Warnings about ``raw`` (the file after overrides) that do not make it invalid."""
    from lmforge.config.schema import SECTION_CLASSES

    warnings: list[str] = []
    for dotted, why in INERT_FIELDS.items():
        present, value = _lookup(raw, dotted)
        if not present:
            continue
        section, name = dotted.rsplit(".", 1)
        cls = SECTION_CLASSES[section.split(".")[0]]
        # A key the section class does not declare (the model section's are its family's) has no
        # default here: writing it at all is what warns.
        declared = name in cls.model_fields
        if not declared or value != cls.model_fields[name].default:
            warnings.append(f"{dotted} = {value!r} has no effect in lmforge: {why}.")
    for section, why in INERT_SECTIONS.items():
        if raw.get(section) is not None:
            warnings.append(f"{section} is accepted but has no effect: {why}.")
    warnings.extend(_unknown_top_level(raw, SECTION_CLASSES))
    present, sp = _lookup(raw, "parallelism.sequence_parallel")
    if present and sp is False and cfg.parallelism.tensor_parallel > 1:
        warnings.append(
            "parallelism.sequence_parallel: False is overridden: sequence parallel is always on when "
            f"tensor_parallel > 1 (here {cfg.parallelism.tensor_parallel}), as the spec says."
        )
    warnings.extend(_conditionally_inert(cfg.parallelism))
    present, pretrained = _lookup(raw, "model.from_pretrained")
    if present and not cfg.checkpoint.load_path:
        warnings.append(
            f"model.from_pretrained = {pretrained!r} gives the model's structure only, and checkpoint.load_path "
            "is empty: the run starts from freshly initialised weights. To fine-tune, set checkpoint.load_path "
            f"to {pretrained!r} with checkpoint.no_load_optim: true."
        )
    return warnings


def _conditionally_inert(parallelism: ParallelismConfig) -> list[str]:
    # Settings that do something in some layouts only; the section's own values say which.
    notes = []
    if parallelism.context_parallel_async and parallelism.context_parallel == 1:
        notes.append(
            "parallelism.context_parallel_async: true has no effect with context_parallel 1 (there is no "
            "context-parallel communication to overlap)."
        )
    if parallelism.disable_gradient_division is False:
        notes.append(
            "parallelism.disable_gradient_division: false has no numerical effect: lmforge always sums "
            "gradients over data-parallel ranks and divides once, by the global token count, in the loss."
        )
    return notes


def inert_fields(path: str) -> dict[str, str]:
    """The keys of the section at ``path`` (e.g. ``"model"``) that INERT_FIELDS lists, with why each has
    no effect."""
    return {d.rsplit(".", 1)[1]: why for d, why in INERT_FIELDS.items() if d.rsplit(".", 1)[0] == path}


def inert_keys(path: str, section: Section) -> list[str]:
    """The keys of the typed section at ``path`` (e.g. ``"parallelism"``) that INERT_FIELDS lists and that
    ``section`` sets to something other than their default (what ``lmforge check`` names)."""
    cls = type(section)
    named = []
    for dotted in INERT_FIELDS:
        owner, name = dotted.rsplit(".", 1)
        if (
            owner == path
            and name in cls.model_fields
            and getattr(section, name) != cls.model_fields[name].default
        ):
            named.append(name)
    return named
