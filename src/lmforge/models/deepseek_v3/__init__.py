"""``model_type: deepseek_v3`` (alias ``deepseek_mtp``): config schema (config.py), model (model.py), HF adapter,
TP plan (parallelize.py)."""

from lmforge.models.deepseek_v3 import config, hf_adapter, parallelize
from lmforge.models.deepseek_v3.model import DeepseekV3ForCausalLM
from lmforge.models.family import Family, HFAdapter
from lmforge.models.registry import register

FAMILY = register(
    Family(
        keys=config.KEYS,
        model_classes={"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM},
        to_transformer_config=config.to_transformer_config,
        hf_adapter=HFAdapter(
            hf_adapter.from_hf,
            hf_adapter.to_hf,
            hf_adapter.hf_config,
            derived_keys=hf_adapter.HF_DERIVED_KEYS,
            renames=hf_adapter.HF_RENAMES,
        ),
        tp_plan=parallelize.tp_plan,
        aliases=("deepseek_mtp",),
    )
)

__all__ = ["DeepseekV3ForCausalLM", "FAMILY"]
