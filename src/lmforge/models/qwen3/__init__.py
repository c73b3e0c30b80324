"""``model_type: qwen3``: config schema (config.py), model (model.py), HF adapter, TP plan (parallelize.py)."""

from lmforge.models.family import Family, HFAdapter
from lmforge.models.qwen3 import config, hf_adapter, parallelize
from lmforge.models.qwen3.model import Qwen3ForCausalLM
from lmforge.models.registry import register

FAMILY = register(
    Family(
        keys=config.KEYS,
        model_classes={"Qwen3ForCausalLM": Qwen3ForCausalLM},
        to_transformer_config=config.to_transformer_config,
        hf_adapter=HFAdapter(hf_adapter.from_hf, hf_adapter.to_hf, hf_adapter.hf_config),
        tp_plan=parallelize.tp_plan,
    )
)

__all__ = ["FAMILY", "Qwen3ForCausalLM"]
