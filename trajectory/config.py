"""The trajectory manager's typed configuration: the ``[trajectory]`` section of a run's TOML."""

from pydantic import BaseModel, ConfigDict, Field


class TrajectoryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="sessions built at once (each reads its calls back and publishes samples)",
    )
