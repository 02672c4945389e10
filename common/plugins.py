"""Parts a run chooses by ``kind``, built in or added by another package: rollout engines and
trainer backends.

A part is a config class (a ``PartConfig`` with ``kind: Literal["<kind>"]``) that names the
module running it (``implementation``: an engine module has ``async def start(config)``, a
backend module ``def build(model, config)``). Built-in parts are listed by their service;
another package adds one as an entry point of the group ``seamlessflow.engines`` or
``seamlessflow.trainer_backends``, named by its kind, whose value is its config class::

    [project.entry-points."seamlessflow.engines"]
    mine = "mypackage.config:MyEngineConfig"

The group is read when the service's config module is imported, so the config class's own
module must not import that service (its ``implementation`` may). A part that is for
benchmarks only says why in ``benchmark_only``; a process running one logs it first, as a
warning (``announce``), and the run's summary lists it.
"""

import logging
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from common.exceptions import SeamlessFlowError
from common.log import kv

log = logging.getLogger(__name__)

ENGINE_GROUP = "seamlessflow.engines"
"""The entry point group of rollout engines."""
BACKEND_GROUP = "seamlessflow.trainer_backends"
"""The entry point group of trainer backends."""


class PluginError(SeamlessFlowError):
    """A part's entry point does not load, or clashes with another part."""


class PartConfig(BaseModel):
    """The config of a part chosen by ``kind``: its own options, and the class variables
    below."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    implementation: ClassVar[str]
    """The module that runs this part."""
    benchmark_only: ClassVar[str] = ""
    """Why this part is for benchmarks only (its results mean nothing); empty: it is not."""

    @classmethod
    def part_kind(cls) -> str:
        return str(cls.model_fields["kind"].default)


def part_configs(group: str, builtin: Sequence[type[PartConfig]]) -> dict[str, type[PartConfig]]:
    """Kind -> config class: the built-in parts, then the entry points of ``group`` by name."""
    found = {config.part_kind(): config for config in builtin}
    for point in sorted(entry_points(group=group), key=lambda p: p.name):
        try:
            config = point.load()
        except Exception as exc:
            raise PluginError(f"{group} entry point {point.name!r} ({point.value}): {exc}") from exc
        if not (isinstance(config, type) and issubclass(config, PartConfig)):
            raise PluginError(f"{group} entry point {point.name!r}: {point.value} is no PartConfig")
        kind = config.part_kind()
        if kind != point.name or kind in found:
            raise PluginError(
                f"{group} entry point {point.name!r}: its config's kind is {kind!r}, which must "
                f"be the entry point's name and not one of {sorted(found)}"
            )
        found[kind] = config
    return found


def announce(part: str, config: PartConfig) -> None:
    """Log, as a warning, that ``config`` chooses a part for benchmarks only (if it does)."""
    if config.benchmark_only:
        log.warning(
            kv("benchmark_only", part=part, kind=config.part_kind(), note=config.benchmark_only)
        )
