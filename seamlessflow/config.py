"""The configuration of a local run: one typed model read from TOML; each part gets its section."""

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.config import EmbeddedBrokerConfig, ProvisionConfig
from broker.subjects import NAME_PATTERN
from seamlessflow.exceptions import SeamlessFlowError


class ConfigError(SeamlessFlowError):
    """A configuration file is missing, unreadable or invalid."""


DEFAULT_RUN = "quickstart"


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(
        default=DEFAULT_RUN, pattern=NAME_PATTERN, description="run name; namespaces every subject"
    )
    broker: EmbeddedBrokerConfig = Field(default_factory=EmbeddedBrokerConfig)
    provision: ProvisionConfig = Field(default_factory=ProvisionConfig)


def load_config(path: Path | None) -> RunConfig:
    """Defaults when ``path`` is None; else the TOML file, validated, with errors that name it."""
    if path is None:
        return RunConfig()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    try:
        # The file overrides the defaults key by key, so a partial section keeps the rest.
        return RunConfig.model_validate(_merge(RunConfig().model_dump(), data))
    except ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = _merge(base[key], value)
        else:
            out[key] = value
    return out
