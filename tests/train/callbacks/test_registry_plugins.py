"""callbacks: [{type: ...}]: registered names, import paths, entry points, and the errors."""

from __future__ import annotations

import sys
import textwrap
from importlib import metadata

import pytest

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.train.callbacks import plugins
from lmforge.train.callbacks.registry import build_callback

MODULE = textwrap.dedent(
    """
    from lmforge.train.callbacks import TrainerCallback

    class CountSteps(TrainerCallback):
        def __init__(self, log_interval=1):
            self.log_interval = log_interval
            self.steps = 0

        def on_step_end(self, args, state, **kwargs):
            self.steps += 1

    class NotACallback:
        pass
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_callbacks_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.ALLOW_IMPORTS_ENV, "1")
    yield "my_callbacks_mod"
    sys.modules.pop("my_callbacks_mod", None)


@pytest.mark.parametrize("sep", [":", "."])
def test_import_path_builds_user_callback_with_its_keys(user_module, sep):
    cb = build_callback(
        validate_section("callbacks", {"type": f"{user_module}{sep}CountSteps", "log_interval": 10}), 0
    )
    assert type(cb).__name__ == "CountSteps" and cb.log_interval == 10


def test_entry_point(user_module, monkeypatch):
    ep = metadata.EntryPoint(
        name="EntryPointOnlyCallback", value=f"{user_module}:CountSteps", group=plugins.ENTRY_POINT_GROUP
    )
    real = metadata.entry_points
    monkeypatch.setattr(
        plugins.metadata,
        "entry_points",
        lambda **kw: [ep] if kw.get("group") == plugins.ENTRY_POINT_GROUP else real(**kw),
    )
    assert (
        type(build_callback(validate_section("callbacks", {"type": "EntryPointOnlyCallback"}), 0)).__name__
        == "CountSteps"
    )


def test_builtin_max_logits_is_known_without_importing_it_first():
    cb = build_callback(validate_section("callbacks", {"type": "MaxLogitsMonitor", "step_interval": 3}), 0)
    assert cb.step_interval == 3


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        (
            {"type": "NoSuchCallback"},
            "callbacks[2].type: unknown callback 'NoSuchCallback'; registered callbacks:",
        ),
        ({"type": "no_such_module_xyz:Thing"}, "cannot import 'no_such_module_xyz'"),
        ({"type": "my_callbacks_mod:Missing"}, "has no attribute 'Missing'"),
        ({"type": "my_callbacks_mod:NotACallback"}, "is not a callback class"),
        ({"type": "my_callbacks_mod:CountSteps", "bad_key": 1}, "invalid arguments ['bad_key']"),
        ({"type": "MaxLogitsMonitor", "step_interval": -1}, "step_interval must be a positive int"),
    ],
)
def test_registry_errors(user_module, item, needle):
    with pytest.raises(ConfigError) as err:
        build_callback(validate_section("callbacks", item), 2)
    assert needle in str(err.value)


def test_unknown_type_lists_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        build_callback(validate_section("callbacks", {"type": "callbackA", "param": 1}), 0)
    assert "MaxLogitsMonitor" in str(err.value) and "LossCallback" in str(err.value)


def test_import_path_needs_the_opt_in(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    (tmp_path / "hostile_cb_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.ALLOW_IMPORTS_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        build_callback(validate_section("callbacks", {"type": "hostile_cb_mod:CountSteps"}), 0)
    assert "--allow-imports" in str(err.value) and not marker.exists()
    assert "hostile_cb_mod" not in sys.modules
