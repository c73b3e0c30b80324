"""``Family``: everything lmforge knows about one model family, declared in the family's own folder.

A family folder ``models/<family>/`` builds one ``Family`` and calls ``registry.register`` in its
``__init__.py``; ``registry`` discovers the folders (and the ``lmforge.models`` entry point group for
families shipped in other packages). Nothing outside the folder names a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmforge.models.common.config_keys import FamilyKeys
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.tp_plan import TPPlan
from lmforge.models.common.transformer_config import TransformerConfig


@dataclass(frozen=True)
class HFAdapter:
    """Hugging Face interchange: state dicts both ways (``from_hf`` pops what it uses from its input)
    and the config.json of a model."""

    from_hf: Callable[[dict, TransformerConfig], dict]
    to_hf: Callable[[dict, TransformerConfig], dict]
    hf_config: Callable[[TransformerConfig], dict]
    derived_keys: tuple[str, ...] = ()  # config.json keys computed from others (not model-section keys)
    renames: Mapping[str, str] = field(default_factory=dict)  # config.json name → model-section name


@dataclass(frozen=True)
class Family:
    """One ``model_type``.

    * ``keys``: the model section's schema (Hugging Face keys with defaults; MoE / MLA key sets);
      ``keys.model_type`` is the family's name, ``keys.architectures`` its architecture names.
    * ``model_classes``: architecture name → ``GPTModel`` subclass (which names its ``LayerBlocks``).
    * ``to_transformer_config``: validated section values → ``TransformerConfig`` (``model_type`` set to
      ``keys.model_type``).
    * ``hf_adapter``: Hugging Face names and config.json.
    * ``tp_plan``: ``(cfg, layer_id) → TPPlan`` of a decoder layer; ``None`` refuses tensor parallel.
    * ``aliases``: other ``model_type`` spellings that mean this family.
    """

    keys: FamilyKeys
    model_classes: Mapping[str, type[GPTModel]]
    to_transformer_config: Callable[[dict[str, Any]], TransformerConfig]
    hf_adapter: HFAdapter
    tp_plan: Callable[[TransformerConfig, int], TPPlan] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        return self.keys.model_type

    def __post_init__(self) -> None:
        if set(self.model_classes) != set(self.keys.architectures):
            raise ValueError(
                f"family {self.model_type!r}: model_classes {sorted(self.model_classes)} must name exactly the "
                f"architectures of its keys {list(self.keys.architectures)}."
            )
        for name, cls in self.model_classes.items():
            if not (isinstance(cls, type) and issubclass(cls, GPTModel)) or cls.blocks is None:
                raise ValueError(
                    f"family {self.model_type!r}: {name} must be a GPTModel subclass that declares its blocks."
                )
