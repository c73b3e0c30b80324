"""lmforge's own speed sections (extensions; absent from the original's YAMLs): compile, float8, mfu."""

from __future__ import annotations

from pydantic import model_validator

from lmforge.config.base import Float, Section, check_one_of

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FLOAT8_RECIPES = ("tensorwise", "rowwise")


class CompileConfig(Section):
    """Regional ``torch.compile``: each transformer block compiled on its own (parallel/compile.py)."""

    enable: bool = False
    backend: str = "inductor"
    mode: str = "default"
    fullgraph: bool = False
    # None: torch's automatic dynamic shapes (one recompile at the first new shape, then dynamic).
    dynamic: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> CompileConfig:
        check_one_of(self.mode, "compile.mode", COMPILE_MODES)
        return self


class Float8Config(Section):
    """torchao float8 training of the Linear layers (parallel/float8.py)."""

    enable: bool = False
    recipe: str = "tensorwise"
    # torchao's emulation mode: float8 numerics without float8 matmul hardware (tests, CPU).
    emulate: bool = False
    # Linear layers whose qualified name contains one of these stay in high precision.
    skip: list[str] = ["output_layer", "router", "eh_proj"]

    @model_validator(mode="after")
    def _check(self) -> Float8Config:
        check_one_of(self.recipe, "float8.recipe", FLOAT8_RECIPES)
        return self


class MfuConfig(Section):
    """The MFU denominator: a datasheet peak (TFLOP/s per device) instead of the built-in table."""

    peak_tflops: Float | None = None

    @model_validator(mode="after")
    def _check(self) -> MfuConfig:
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"mfu.peak_tflops must be positive, got {self.peak_tflops}")
        return self
