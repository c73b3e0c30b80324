"""Sections read by the building blocks: optimizer, lr_scheduler, train_dataset, model (mostly open)."""

from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr, model_validator

from lmforge.config.base import OpenSection, Section, check_positive
from lmforge.config.registry import expand_section, typed_section

# --------------------------------------------------------------------------------------------------
# optimizer and lr_scheduler


class OptimizerConfig(OpenSection):
    """``type`` picks the optimizer; every other key passes through, as the file wrote it, to the schema
    optim/ registered for that type (lmforge.optim.specs), the one owner of each key's default, range
    and message: a Muon section that omits ``eps`` gets Muon's own default, not AdamW's."""

    type: str = "AdamW"

    # The options the registered schema of ``type`` made of this section (lmforge.config.registry);
    # None when the section was validated on its own.
    _typed: Any = PrivateAttr(default=None)

    @property
    def typed(self) -> Any:
        """The typed, validated form of this section (``lmforge.optim.OptimizerOptions``), or None."""
        return self._typed

    @model_validator(mode="after")
    def _type_by_type(self) -> OptimizerConfig:
        # The optimizer's keys depend on its type: the schema optim/ registered for it validates them
        # whenever the section is typed (load_config, or validate_section("optimizer", ...)).
        self._typed = typed_section("optimizer", self.type, self, "optimizer", {})
        return self


class LrSchedulerConfig(OpenSection):
    """``type`` picks the scheduler; every other key (``learning_rate`` included) passes through, as the
    file wrote it, to the schema lr/ registered for that type (lmforge.lr.specs), its one owner."""

    type: str

    # The scheduler the registered schema of ``type`` made of this section (lmforge.config.registry);
    # None when no schema is registered (the config package used on its own).
    _typed: Any = PrivateAttr(default=None)

    @property
    def typed(self) -> Any:
        """The typed, validated form of this section (an ``lmforge.lr.SchedulerSpec``, whose
        ``schedule(total_steps)`` is the schedule), or None."""
        return self._typed

    @model_validator(mode="after")
    def _type_by_type(self) -> LrSchedulerConfig:
        # The scheduler's keys depend on its type: the schema lr/ registered for it validates every key
        # (learning_rate's range included) whenever the section is typed; what depends on
        # training.steps is TrainConfig's check.
        self._typed = typed_section("lr_scheduler", self.type, self, "lr_scheduler", {})
        return self


# --------------------------------------------------------------------------------------------------
# train_dataset


class DataloaderConfig(OpenSection):
    """``type`` picks the loader; every other key passes through, as the file wrote it, to the schema
    data/ registered for that type (lmforge.data.schema), the one owner of each key's default, range
    and message (a text loader's default columns are not a Megatron loader's)."""

    type: str

    # The loader the registered schema of ``type`` made of this section (lmforge.config.registry);
    # None when no schema is registered (the config package used on its own).
    _typed: Any = PrivateAttr(default=None)

    @property
    def typed(self) -> Any:
        """The typed, validated form of this section (``lmforge.data.schema.MegatronLoader`` or
        ``TextLoader``), or None."""
        return self._typed


class TrainDatasetConfig(Section):
    dataloader: DataloaderConfig
    drop_remainder: bool = True
    num_parallel_workers: int = 8
    prefetch_size: int = 1
    numa_enable: bool = False
    use_distribute_dataset: bool = False

    @model_validator(mode="after")
    def _check(self) -> TrainDatasetConfig:
        if self.num_parallel_workers < 0:
            raise ValueError(
                f"train_dataset.num_parallel_workers must be an integer >= 0; got {self.num_parallel_workers}"
            )
        check_positive(self.prefetch_size, "train_dataset.prefetch_size")
        return self

    @model_validator(mode="after")
    def _type_dataloader(self) -> TrainDatasetConfig:
        # The loader's keys depend on its type: the schema data/ registered for it checks every key now,
        # before anything is built (what needs the model is TrainConfig's check against it).
        loader = self.dataloader
        loader._typed = typed_section(
            "train_dataset.dataloader", loader.type, loader, "train_dataset.dataloader", {}
        )
        return self


# --------------------------------------------------------------------------------------------------
# model


class ModelConfig(OpenSection):
    model_type: str
    # Required too, but refused by the family's schema, whose message names the architecture that
    # model_type takes ("model.architectures is required ...; for model_type 'llama' use LlamaForCausalLM").
    architectures: str | None = None

    # The typed section, structure and model class the registered schema of ``model_type`` made of
    # this section (lmforge.config.registry); None when no schema is registered (config used alone).
    _typed: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _expand(cls, data: Any) -> Any:
        # model.from_pretrained: DIR takes the section from DIR/config.json (models/ registers it).
        return expand_section("model", data)

    @property
    def typed(self) -> Any:
        """The typed, validated form of this section (``lmforge.models.schema.TypedModel``), or None."""
        return self._typed

    @model_validator(mode="after")
    def _type_by_family(self) -> ModelConfig:
        # The model's keys depend on its family: the schema models/ registered for model_type validates
        # them whenever the section is typed (load_config, or validate_section("model", ...)). Its keys
        # are the family's, not this class's, so the schema gets them as the file gave them.
        self._typed = typed_section("model", self.model_type, self.to_dict(), "model", {})
        return self

    def layer_count(self) -> int | None:
        """Decoder layers plus MTP layers, or None when the section does not say."""
        layers = None
        for key in ("num_hidden_layers", "num_layers"):
            value = getattr(self, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                layers = value
                break
        if layers is None:
            return None
        mtp = 0
        for key in ("mtp_num_layers", "num_nextn_predict_layers"):
            value = getattr(self, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                mtp = value
                break
        return layers + max(mtp, 0)
