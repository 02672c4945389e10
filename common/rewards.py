"""Which rewards are usable: one rule for every part that takes a reward.

The agent runner checks the rewards it computes (an unusable one leaves the attempt unscored:
``rollout.agents.rewards``); the trajectory manager checks every ``SessionEnded`` it gets,
the runner's and those of clients that drive the gateway themselves (an unusable one is
dead-lettered: ``trajectory.manager``). Both read the range from the run config's one
``[rewards]`` section (``RewardsConfig``), so they cannot disagree: a reward the runner lets
through is never refused after it.
"""

import math
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.exceptions import UnusableRewardError


class RewardsConfig(BaseModel):
    """The ``[rewards]`` section of the run TOML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    range: tuple[float, float] = Field(
        default=(-1.0, 1.0),
        description="[low, high]: a reward outside it, NaN or inf is unusable (the agent runner "
        "leaves the attempt unscored; the trajectory manager dead-letters a SessionEnded)",
        json_schema_extra={"flag": "reward-range"},
    )

    @model_validator(mode="after")
    def _a_range(self) -> Self:
        low, high = self.range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"rewards.range: need finite low < high, got [{low}, {high}]")
        if not low <= 0.0 <= high:
            raise ValueError(
                f"rewards.range [{low}, {high}] must hold 0.0, the reward of a failed attempt"
            )
        return self


def checked(value: object, reward_range: tuple[float, float]) -> float:
    """``value`` as a reward; ``UnusableRewardError`` when it is not a finite number in
    ``reward_range``."""
    low, high = reward_range
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnusableRewardError("not_a_number", f"{type(value).__name__} {value!r:.60}")
    reward = float(value)
    if not math.isfinite(reward):
        raise UnusableRewardError("not_finite", f"{reward}")
    if not low <= reward <= high:
        raise UnusableRewardError("out_of_range", f"{reward:g}, outside [{low:g}, {high:g}]")
    return reward
