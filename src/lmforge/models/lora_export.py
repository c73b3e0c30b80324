"""LoRA adapters in the PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``).

lmforge fuses projections that Hugging Face keeps apart (``linear_qkv``: q, k and v rows grouped per
key-value group; ``linear_fc1``: gate/up row pairs). One adapter on a fused weight is exactly one adapter
per Hugging Face projection: they share ``A`` and each takes its rows of ``B`` (``ΔW = B A``, so a row
selection of ``ΔW`` is that selection of ``B`` times ``A``). The rows are found by running the family's own
``to_hf`` mapping over a state dict in which each adapted weight is replaced by its *row ids* (``[out, 1]``
int64, as ``models/hf_read.py`` does): the ids that come out under a Hugging Face name say which rows of
which ``B`` it is made of. A mapping that does anything else with an adapted weight (mixes two adapted
weights, drops rows) is refused rather than exported wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lmforge.errors import CheckpointError
from lmforge.models.lora import is_lora_param_name, lora_modules

PEFT_PREFIX = "base_model.model."
_ROW_BITS = 40


def peft_adapter_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(PEFT tensors by name, Hugging Face module names that carry an adapter) of a LoRA model."""
    from lmforge.models.registry import family_for

    cfg = model.config
    to_hf = family_for(cfg.model_type).hf_adapter.to_hf
    mods = lora_modules(model)
    if not mods:
        raise CheckpointError(
            "the model has no LoRA adapters (lora_config); there is no PEFT adapter to write."
        )
    base = {k: v.detach().cpu() for k, v in model.state_dict().items() if not is_lora_param_name(k)}
    names = sorted(mods)
    with_ids = dict(base)
    for number, name in enumerate(names):
        rows = mods[name].lora_B.weight.shape[0]
        with_ids[f"{name}.weight"] = ((number << _ROW_BITS) + torch.arange(rows, dtype=torch.int64)).view(
            rows, 1
        )
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    covered: dict[str, list[torch.Tensor]] = {}
    for key, ids in to_hf(with_ids, cfg).items():
        if ids.dtype != torch.int64:
            continue
        owners = (ids >> _ROW_BITS).unique()
        name = names[int(owners[0])]
        if not key.endswith(".weight") or ids.dim() != 2 or ids.shape[1] != 1 or owners.numel() != 1:
            raise CheckpointError(
                f"cannot write a PEFT adapter for {name}: the {cfg.model_type} Hugging Face mapping does not map "
                f"its weight to {key} by whole rows. Export the merged model instead (lmforge convert without --peft)."
            )
        rows = ids.reshape(-1) & ((1 << _ROW_BITS) - 1)
        covered.setdefault(name, []).append(rows)
        m = mods[name]
        hf_module = key[: -len(".weight")]
        tensors[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = m.lora_A.weight.detach().cpu().float().clone()
        tensors[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = (
            m.lora_B.weight.detach().cpu().float().index_select(0, rows).contiguous()
        )
        targets.append(hf_module)
    lost = sorted(
        n
        for n in names
        if n not in covered
        or not torch.equal(torch.cat(covered[n]).sort().values, torch.arange(mods[n].lora_B.weight.shape[0]))
    )
    if lost:
        raise CheckpointError(
            f"cannot write a PEFT adapter: {', '.join(lost[:4])} has no Hugging Face counterpart covering each "
            f"of its rows once in the {cfg.model_type} mapping. Export the merged model instead (lmforge "
            "convert without --peft)."
        )
    return tensors, targets


def save_peft_adapter(model: nn.Module, path: str | Path, base_model_dir: str | Path) -> None:
    """Write a PEFT LoRA adapter directory that ``peft.PeftModel.from_pretrained`` loads onto the
    Hugging Face base model in ``base_model_dir`` (the unmerged base, as ``save_hf_pretrained`` writes it)."""
    tensors, targets = peft_adapter_tensors(model)
    s = model.lora_settings
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_model_dir).resolve()),
        "r": int(s["lora_rank"]),
        "lora_alpha": s["lora_alpha"],
        "lora_dropout": s["lora_dropout"],
        # PEFT matches a list entry by exact name or name suffix; these are full module names.
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
