"""verl's fully-async rhythm (``recipe.fully_async_policy``), for comparing with its published
gains: the simulator's cluster runs it in place of the scheduler's admission and its weight
update after every step."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Rhythm:
    """verl's rollouter and parameter sync: the rollout engines get new weights every
    ``sync_every`` trainer steps (``trigger_parameter_sync_step``); between two syncs the
    rollouter starts groups while the groups it counts stay under ``budget`` =
    ``sync_every * groups_per_step * (1 + staleness)`` (``staleness_threshold``, fractional);
    at each sync the count restarts from the groups still running or waiting for the trainer
    (its ``reset_staleness``). ``staleness`` 0 with ``sync_every`` > 1 is verl's "stream
    off-policy pipeline"; above 0, with partial rollout, its "async stream pipeline with partial
    rollout"."""

    sync_every: int = 1
    staleness: float = 0.0

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"rhythm.sync_every must be >= 1, got {self.sync_every}")
        if self.staleness < 0:
            raise ValueError(f"rhythm.staleness must be >= 0, got {self.staleness}")

    def budget(self, groups_per_step: int) -> int:
        """Groups the rollouter may count between two syncs."""
        return int(self.sync_every * groups_per_step * (1 + self.staleness))

    def syncs(self, version: int) -> bool:
        """Whether the trainer's new ``version`` is sent to the rollout engines."""
        return version % self.sync_every == 0
