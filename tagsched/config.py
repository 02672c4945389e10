"""The scheduler's settings (``[scheduler]``) and the cluster layout (``[layout]``)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.config import Tags
from broker.messages import NAME_PATTERN
from broker.registry import default_worker_id
from tagsched.spec import Demand, Layout, PlacementSpec, layout_spec

REST = "rest"


class RoleDemand(BaseModel):
    """``[layout.train]`` or ``[layout.rollout]``: what the user asks of one role's workers, on
    top of the layout kind's demand (``train``: workers tagged ``train``, one of them;
    ``rollout``: every other worker tagged ``rollout``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tags: Tags = Field(
        default_factory=list,
        description="tags its workers must have besides the kind's (gpu=h200, node=a1; a bare "
        "key matches any value: gpu)",
    )
    count: int | Literal["rest"] | None = Field(
        default=None,
        description="how many workers hold the role, or 'rest': every remaining worker that has "
        "the tags (at least one); default: the kind's (train 1, rollout rest)",
    )

    @field_validator("count", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        if isinstance(value, str) and value.isdigit():
            return int(value)  # a flag's text
        if (
            value is None
            or value == REST
            or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
        ):
            return value
        raise ValueError(
            f"count is a number of workers (0 or more) or {REST!r} (every remaining worker "
            f"that has the tags), not {value!r}"
        )

    def refine(self, demand: Demand) -> Demand:
        """``demand`` with these tags added and this count, if given."""
        tags = [*demand.tags, *(t for t in self.tags if t not in demand.tags)]
        count = demand.count if self.count is None else None if self.count == REST else self.count
        return Demand(tags=tags, count=count)


class LayoutConfig(BaseModel):
    """How the run's workers share the work: the kind's spec (three specs of one mechanism,
    ``tagsched.spec``), refined per role by the user's tags and counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Layout = Field(
        default=Layout.DISAGGREGATED,
        description="colocated, disaggregated or multiplexed; on 2 cores the three ran the "
        "quickstart within 10% of each other (bench/layouts.py)",
        json_schema_extra={"flag": "layout"},
    )
    train: RoleDemand = Field(
        default_factory=RoleDemand, description="the trainer's workers: their tags and count"
    )
    rollout: RoleDemand = Field(
        default_factory=RoleDemand, description="the rollout workers: their tags and count"
    )

    def spec(self) -> PlacementSpec:
        base = layout_spec(self.kind)
        return base.model_copy(
            update={
                "train": self.train.refine(base.train),
                "rollout": self.rollout.refine(base.rollout),
            }
        )


class SchedulerConfig(BaseModel):
    """One scheduler process (one is active per run; others stand by)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduler_id: str = Field(
        default_factory=lambda: default_worker_id("scheduler-", pid=False),
        pattern=NAME_PATTERN,
        description="this scheduler's name in the lease: stable across restarts (a restarted "
        "scheduler takes its own lease over at once), unique among the run's schedulers; "
        "default: scheduler-<host>",
    )
    steps_ahead: int = Field(
        default=2,
        ge=1,
        description="admission control: groups outstanding (admitted, not yet trained), in "
        "trainer steps; at most trainer.max_staleness + 1",
    )
    wave_wait_s: float = Field(
        default=5.0,
        ge=0,
        description="admission holds a task up to this long while rollout workers load a new "
        "weight version, so that it starts on (and is stamped with) the newest one",
    )
    tick_s: float = Field(default=0.2, gt=0, description="how often assignments are checked")
    role_change_deadline_s: float = Field(
        default=30.0, gt=0, description="a worker not acking a role change by then is fenced"
    )
    placement_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="an unsatisfiable placement spec fails the scheduler after this long",
    )
    lend_gain: float = Field(
        default=2.0,
        ge=1,
        description="lend a trainer worker only when the trainer would wait this many times the "
        "measured switch cost (lend + reclaim)",
    )
    switch_cost_s: float = Field(
        default=0.5, gt=0, description="assumed switch cost until switches have been measured"
    )
    rate_window_s: float = Field(
        default=30.0,
        gt=0,
        description="smoothing of the group arrival rate the lending gate divides by; keep it "
        "longer than the gaps between group arrivals (a 5 s window decayed towards zero between "
        "them, the trainer's wait looked endless and lends at 10x the switch cost went on: "
        "bench/sim.py)",
    )
