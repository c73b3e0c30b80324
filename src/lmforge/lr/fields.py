"""Reading and checking the keys of one ``lr_scheduler`` mapping.

Every error names the key by its full dotted path (``lr_scheduler.warmup_steps``, or
``lr_scheduler.base_lr.warmup_steps`` inside a LearningRateWiseLayer) and, where the original
MindFormers code has an exact message for the same mistake, contains that text.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

from lmforge.errors import ConfigError

# A product ratio × total that lies this close to a whole number counts as that number, so that
# 0.29 × 100 gives 29 warm-up steps (binary floating point gives 28.999999999999996).
_WHOLE_NUMBER_TOLERANCE = 1e-9


def floor_ratio_of(ratio: float, total_steps: int) -> int:
    """``floor(ratio × total_steps)``, immune to the rounding error of the float product."""
    product = ratio * total_steps
    nearest = round(product)
    if abs(product - nearest) <= _WHOLE_NUMBER_TOLERANCE * max(1.0, abs(product)):
        return int(nearest)
    return math.floor(product)


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SchedulerKeys:
    """The keys of one scheduler mapping, read with type and range checks.

    ``path`` is the dotted path of the mapping itself (``lr_scheduler``); ``type_name`` is the
    scheduler's registered name, used in messages.
    """

    def __init__(self, values: dict[str, Any], path: str, type_name: str) -> None:
        self.values = values
        self.path = path
        self.type_name = type_name

    def dotted(self, key: str) -> str:
        return f"{self.path}.{key}"

    def given(self, key: str) -> bool:
        """Whether the key is set; an explicit YAML ``null`` counts as not set (as in the original)."""
        return self.values.get(key) is not None

    def error(self, key: str, reason: str) -> ConfigError:
        return ConfigError(f"{self.dotted(key)}: {reason}")

    # -- typed readers -------------------------------------------------------------------------

    def steps(self, key: str, default: int | None, tag: str | None = None) -> int | None:
        """A whole number of steps >= 0 (``tag`` gives the original's wording, e.g. ``warmup``)."""
        if not self.given(key):
            return default
        value = self.values[key]
        tag = tag or key
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(
                key,
                f"The type of {tag}_step must be int, but got {type(value)}. {self.type_name} needs a whole "
                f"number of steps >= 0 here, got {_show(value)}.",
            )
        if value < 0:
            raise self.error(
                key,
                f"The {tag}_step must be >= 0, but got {value}. Give a whole number of steps >= 0.",
            )
        return value

    def positive_int(self, key: str, original_message: str) -> int:
        """A required integer >= 1 (``t_max``, ``t_0``, ``t_mult``)."""
        if not self.given(key):
            raise self.error(key, f"{self.type_name} requires {key}, a positive integer; it is not set.")
        value = self.values[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.error(
                key, f"{original_message.format(value=value)}. Give an integer >= 1, got {_show(value)}."
            )
        return value

    def ratio(self, key: str, tag: str) -> float | None:
        """A fraction of the total steps in [0, 1], or None when not set."""
        if not self.given(key):
            return None
        value = self.values[key]
        if not _is_number(value):
            raise self.error(
                key,
                f"The type of {tag}_ratio must be float or int, but got {type(value)}. Give a number in "
                f"[0, 1] (a fraction of training.steps), got {_show(value)}.",
            )
        if not (0.0 <= value <= 1.0):  # also refuses NaN
            raise self.error(
                key,
                f"The {tag}_ratio's value range must be in [0,1], but got {value}. It is a fraction of "
                f"training.steps.",
            )
        return float(value)

    def number(
        self, key: str, default: float, *, minimum: float | None = 0.0, what: str = "a number"
    ) -> float:
        """A finite float; ``minimum`` (inclusive) keeps learning rates non-negative."""
        if not self.given(key):
            return float(default)
        value = self.values[key]
        if not _is_number(value):
            hint = ""
            if isinstance(value, str):
                hint = (
                    " YAML 1.1 reads a number such as 1e-5 without a dot as text: write 1.e-5 or 1.0e-5 "
                    "instead."
                )
            raise self.error(key, f"must be {what}, got {_show(value)}.{hint}")
        if not math.isfinite(value):
            raise self.error(key, f"must be a finite number, got {value!r}: it would make the lr NaN or inf.")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be {what} >= {minimum:g}, got {value!r}.")
        return float(value)

    # -- whole-mapping checks ------------------------------------------------------------------

    def refuse_unknown(self, accepted: Iterable[str], known_elsewhere: dict[str, list[str]]) -> None:
        """Refuse keys this scheduler does not take (the original silently ignores them).

        ``known_elsewhere`` maps a key to the other schedulers that take it, for a better hint.
        """
        accepted = list(accepted)
        # A key set to null counts as not set (the config schema may list optional keys as None).
        unknown = sorted(k for k in self.values if k not in accepted and self.given(k))
        if not unknown:
            return
        parts = []
        for key in unknown:
            hint = ""
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.75)
            if key in known_elsewhere:
                owners = known_elsewhere[key]
                named = ", ".join(owners) if len(owners) <= 3 else f"{', '.join(owners[:2])} and others"
                hint = f" (it is a setting of {named})"
            elif close:
                hint = f" (did you mean {close[0]}?)"
            parts.append(f"{self.dotted(key)}{hint}")
        noun = "is not a setting" if len(unknown) == 1 else "are not settings"
        raise ConfigError(
            f"{'; '.join(parts)} {noun} of {self.type_name}. {self.type_name} accepts: "
            f"{', '.join(accepted)}. The original silently ignores unknown keys, so a typo would "
            f"change nothing; lmforge refuses it."
        )
