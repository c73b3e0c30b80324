"""Two log lines of torchao's import that tell a user nothing, dropped in every process that imported
lmforge; every other record of those loggers passes.

torchao is imported by lmforge's float8 path and by peft (``import peft`` imports it to probe for its
quantized layers: the PEFT export's check, ``lmforge[lora]`` users loading an adapter). On import,

* torchao tries to load its compiled kernels and logs ``Failed to load .../torchao/_C_*.so`` for each
  one it cannot load. Its wheels carry CUDA kernels only, so on a torch without CUDA every one of them
  fails, by construction, on every import. Only that case is dropped: with a CUDA torch a kernel that
  does not load is a real problem and is still shown.
* torchao registers its enums with torch's pytree (``register_constant``), which torch >= 2.10 answers
  with a deprecation warning addressed to torchao's developers. Dropped only when torchao's own code
  is the caller.
"""

from __future__ import annotations

import logging
import re
import sys

_KERNEL_LOAD = re.compile(r"^Failed to load \S*torchao\S*[/\\]_C[^/\\]*\.so: ")
_ENUM_DEPRECATION = "register_constant() on Enum subclasses is deprecated"


def _torch_has_cuda() -> bool:
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return getattr(version, "cuda", None) is not None


def _called_from_torchao() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "torchao" or name.startswith("torchao."):
            return True
        frame = frame.f_back
    return False


class _TorchaoKernelLoad(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_KERNEL_LOAD.match(record.getMessage()) and not _torch_has_cuda())


class _TorchaoEnumRegistration(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_ENUM_DEPRECATION in record.getMessage() and _called_from_torchao())


def install() -> None:
    """Add the two filters (idempotent). They sit on the emitting loggers, so they hold whatever
    handlers the application configures."""
    for name, cls in (("torchao", _TorchaoKernelLoad), ("torch.utils._pytree", _TorchaoEnumRegistration)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())
