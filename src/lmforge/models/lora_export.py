"""LoRA adapters in the PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``).

lmforge fuses projections that Hugging Face keeps apart (``linear_qkv`` = [q; k; v], ``linear_fc1`` =
[gate; up]). One adapter on a fused weight is exactly one adapter per Hugging Face projection: they share
``A`` and each takes its rows of ``B`` (``ΔW = B A``, so a row slice of ``ΔW`` is that slice of ``B``
times ``A``). The rows are found by running the family's own ``to_hf`` mapping over a state dict in
which each adapted weight is replaced by its ``B``: every Hugging Face tensor that comes out as a row
slice of a ``B`` belongs to that adapter. A mapping that does anything else with an adapted weight
(concatenation, column permutation) is refused rather than exported wrongly.
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


def peft_adapter_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(PEFT tensors by name, Hugging Face module names that carry an adapter) of a LoRA model."""
    from lmforge.models.hf_io import ADAPTERS

    cfg = model.config
    to_hf = ADAPTERS[cfg.model_type].to_hf
    mods = lora_modules(model)
    if not mods:
        raise CheckpointError(
            "the model has no LoRA adapters (lora_config); there is no PEFT adapter to write."
        )
    base = {k: v.detach().cpu() for k, v in model.state_dict().items() if not is_lora_param_name(k)}
    with_b = dict(base)
    owner: dict[int, str] = {}
    for name, m in mods.items():
        b = m.lora_B.weight.detach().cpu().clone()
        with_b[f"{name}.weight"] = b
        owner[b.untyped_storage().data_ptr()] = name
    hf_b = to_hf(with_b, cfg)
    hf_base = to_hf(dict(base), cfg)
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    covered: set[str] = set()
    for key, t in hf_b.items():
        name = owner.get(t.untyped_storage().data_ptr())
        if name is None:
            continue
        m = mods[name]
        r = m.lora_B.weight.shape[1]
        offset = t.storage_offset() // r if r else 0
        rows = t.shape[0]
        base_w = base[f"{name}.weight"]
        if (
            not key.endswith(".weight")
            or t.dim() != 2
            or t.shape[1] != r
            or t.stride() != (r, 1)
            or t.storage_offset() % r
            or not torch.equal(hf_base[key], base_w[offset : offset + rows])
        ):
            raise CheckpointError(
                f"cannot write a PEFT adapter for {name}: the {cfg.model_type} Hugging Face mapping does not map "
                f"its weight to {key} by whole rows. Export the merged model instead (lmforge convert without --peft)."
            )
        hf_module = key[: -len(".weight")]
        tensors[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = m.lora_A.weight.detach().cpu().float().clone()
        tensors[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = t.float().contiguous().clone()
        targets.append(hf_module)
        covered.add(name)
    lost = sorted(set(mods) - covered)
    if lost:
        raise CheckpointError(
            f"cannot write a PEFT adapter: {', '.join(lost[:4])} has no Hugging Face counterpart in the "
            f"{cfg.model_type} mapping. Export the merged model instead (lmforge convert without --peft)."
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
