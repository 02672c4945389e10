"""Parts added by other packages (``common.plugins``): an entry point named by its kind adds a
config class to the kinds; a misnamed, clashing or broken one is refused with its name."""

from importlib.metadata import EntryPoint
from typing import ClassVar, Literal

import pytest

from common import plugins
from common.plugins import ENGINE_GROUP, PartConfig, PluginError, part_configs
from rollout.engines.config import HFEngineConfig


class MineEngineConfig(PartConfig):
    implementation: ClassVar[str] = "tests.test_plugins"
    kind: Literal["mine"] = "mine"


class AnotherHFConfig(PartConfig):
    implementation: ClassVar[str] = "tests.test_plugins"
    kind: Literal["hf"] = "hf"


def _with(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    point = EntryPoint(name, value, ENGINE_GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [point])


def test_an_entry_point_adds_its_kind_after_the_built_in_ones(monkeypatch):
    _with(monkeypatch, "mine", f"{__name__}:MineEngineConfig")
    found = part_configs(ENGINE_GROUP, (HFEngineConfig,))
    assert found == {"hf": HFEngineConfig, "mine": MineEngineConfig}


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("other", f"{__name__}:MineEngineConfig", "its config's kind is 'mine'"),
        ("hf", f"{__name__}:AnotherHFConfig", r"not one of \['hf'\]"),
        ("mine", f"{__name__}:pytest", "is no PartConfig"),
        ("mine", "no_such_package.config:X", "No module named 'no_such_package'"),
    ],
)
def test_a_misnamed_clashing_or_broken_entry_point_is_refused(monkeypatch, name, value, error):
    _with(monkeypatch, name, value)
    with pytest.raises(PluginError, match=error):
        part_configs(ENGINE_GROUP, (HFEngineConfig,))
