"""lmforge: PyTorch-native LLM training from one YAML file."""

__version__ = "0.1.0"

# Quiet by default: torchao's import (float8, or peft's probe for it) logs lines that are no news.
from lmforge.utils.third_party_noise import install as _quiet_torchao  # noqa: E402

_quiet_torchao()

# The packages that own a section with a discriminator register its typed schemas with the config
# (lmforge.config.registry) on import; importing them here makes load_config see them.
import lmforge.lr.schema  # noqa: E402,F401


def _register_model_schemas() -> None:
    # The families import torch: registered on the first load, not on `import lmforge`.
    from lmforge.models.schema import register

    register()


from lmforge.config.registry import register_schema_provider  # noqa: E402

register_schema_provider("model", _register_model_schemas)


def _register_optimizer_schemas() -> None:
    from lmforge.optim.schema import register

    register()


register_schema_provider("optimizer", _register_optimizer_schemas)


def _register_dataloader_schemas() -> None:
    from lmforge.data.schema import register

    register()


register_schema_provider("train_dataset.dataloader", _register_dataloader_schemas)
