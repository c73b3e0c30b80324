"""``model_type: qwen3_moe``: config schema (config.py), model (model.py), HF adapter, TP plan (parallelize.py)."""

from lmforge.models.family import Family, HFAdapter
from lmforge.models.qwen3_moe import config, hf_adapter, parallelize
from lmforge.models.qwen3_moe.model import Qwen3MoeForCausalLM
from lmforge.models.registry import register

FAMILY = register(
    Family(
        keys=config.KEYS,
        model_classes={"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM},
        to_transformer_config=config.to_transformer_config,
        hf_adapter=HFAdapter(
            hf_adapter.from_hf, hf_adapter.to_hf, hf_adapter.hf_config, renames=hf_adapter.HF_RENAMES
        ),
        tp_plan=parallelize.tp_plan,
    )
)

__all__ = ["FAMILY", "Qwen3MoeForCausalLM"]
