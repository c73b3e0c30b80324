"""Validation during training: ``eval_dataset`` (typed like ``train_dataset``) and what it inherits,
and whether an ``eval_interval`` has a validation set to evaluate (checked at load, so that
``lmforge check`` refuses what ``lmforge train`` would fail on).

A ``TextDataLoader`` eval_dataset names its files (``data_path`` or ``valid_data_path``) and takes
every key it does not set — tokenizer, chat template, sequence length, columns, packing, text keys —
from ``train_dataset.dataloader``, as the Hugging Face Trainer's eval set shares the training
set's preprocessing. See docs/config.md ("Validation").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.config.schema import TrainConfig

TEXT_TYPE = "TextDataLoader"
# An eval_dataset's own data: never taken from train_dataset (that would evaluate on training data).
OWN_KEYS = ("data_path", "valid_data_path", "validation_split", "shuffle")


def inherit_eval_dataset(eval_section: Any, train_section: Any) -> Any:
    """The raw ``eval_dataset`` mapping with what a text eval loader leaves unset taken from the
    training loader; its files become the validation set (``valid_data_path``)."""
    if not isinstance(eval_section, Mapping) or not isinstance(train_section, Mapping):
        return eval_section
    loader, train_loader = eval_section.get("dataloader"), train_section.get("dataloader")
    if not isinstance(loader, Mapping) or not isinstance(train_loader, Mapping):
        return eval_section
    if loader.get("type", train_loader.get("type")) != TEXT_TYPE or train_loader.get("type") != TEXT_TYPE:
        return eval_section
    if "validation_split" in loader:
        raise ValueError(
            "eval_dataset.dataloader.validation_split: a share of the training data is held out on "
            "train_dataset.dataloader.validation_split (so that training leaves it out); eval_dataset names "
            "its own files with data_path"
        )
    # Both, equal: a resolved config written back (checkpoint config.yaml) that is read again.
    if (
        "data_path" in loader
        and "valid_data_path" in loader
        and loader["data_path"] != loader["valid_data_path"]
    ):
        raise ValueError(
            "eval_dataset.dataloader names its files twice (data_path and valid_data_path); keep one"
        )
    files = loader.get("data_path", loader.get("valid_data_path"))
    if files is None:
        raise ValueError(
            "eval_dataset.dataloader.data_path is required: the validation files (the other keys are taken "
            "from train_dataset.dataloader when not set)"
        )
    merged = {k: v for k, v in train_loader.items() if k not in OWN_KEYS}
    merged.update({k: v for k, v in loader.items() if k not in ("data_path", "valid_data_path")})
    merged.update(data_path=files, valid_data_path=files)
    section = {k: v for k, v in train_section.items() if k != "dataloader"}
    section.update({k: v for k, v in eval_section.items() if k != "dataloader"})
    section["dataloader"] = merged
    return section


def has_validation_set(loader_typed: Any) -> bool | None:
    """Whether a typed dataloader has a validation split: True, False, or None when only building
    it can tell (a Megatron ``split`` counted in samples, or no schema registered to type it)."""
    if loader_typed is None:
        return None
    # An HFDataLoader is typed as the TextDataLoader it translates to (lmforge.data.hf_loader).
    if getattr(loader_typed, "type", None) == TEXT_TYPE:
        return bool(loader_typed.valid_data_path or loader_typed.validation_split)
    config = getattr(loader_typed, "config", None)
    if config is None:
        return None
    if getattr(config, "valid_data_path", None) is not None:
        return True
    if getattr(config, "data_path", None) is not None:
        weights = getattr(config, "split_weights", None) or [1.0, 0.0, 0.0]  # no split: all training
        return weights[1] > 0
    return False


def refuse_eval_without_validation_set(cfg: TrainConfig) -> None:
    """``eval_interval > 0`` needs a validation set: an ``eval_dataset`` or a validation split of
    ``train_dataset``; a ValueError naming the keys that would give one."""
    if cfg.eval_interval <= 0 or cfg.eval_dataset is not None:
        return
    typed = cfg.train_dataset.dataloader.typed
    if has_validation_set(typed) is not False:
        return
    if typed.type == TEXT_TYPE:
        how = (
            "train_dataset.dataloader.validation_split (e.g. 0.05: a share of data_path held out of training) "
            "or train_dataset.dataloader.valid_data_path (its own files), or an eval_dataset section"
        )
    else:
        how = (
            "a split with a non-zero second part in train_dataset.dataloader.config.split (e.g. '98,2,0'), "
            "or train_dataset.dataloader.config.valid_data_path, or an eval_dataset section"
        )
    raise ValueError(
        f"eval_interval = {cfg.eval_interval} evaluates every {cfg.eval_interval} steps, but there is no "
        f"validation set: give {how}; or set eval_interval: 0"
    )


def eval_dataset_messages(exc: Any) -> list[str]:
    """The messages of a failed ``eval_dataset`` validation, each naming its key under eval_dataset."""
    out = []
    for err in exc.errors():
        text = str((err.get("ctx") or {}).get("error", err["msg"])).replace("train_dataset.", "eval_dataset.")
        where = ".".join(str(p) for p in err["loc"] if isinstance(p, (str, int)))
        out.append(text if text.startswith("eval_dataset") else f"eval_dataset.{where}: {text}".rstrip(". :"))
    return out
