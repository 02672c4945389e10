"""The scheduler's settings (``[scheduler]``) and the cluster layout (``[layout]``)."""

from pydantic import BaseModel, ConfigDict, Field

from broker.messages import NAME_PATTERN
from broker.registry import default_worker_id
from tagsched.spec import Layout, PlacementSpec, layout_spec


class LayoutConfig(BaseModel):
    """How the run's workers share the work: three specs of one mechanism (``tagsched.spec``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Layout = Field(
        default=Layout.DISAGGREGATED,
        description="colocated, disaggregated or multiplexed; on 2 cores the three ran the "
        "quickstart within 10% of each other (bench/layouts.py)",
        json_schema_extra={"flag": "layout"},
    )

    def spec(self) -> PlacementSpec:
        return layout_spec(self.kind)


class SchedulerConfig(BaseModel):
    """One scheduler process (one is active per run; others stand by)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduler_id: str = Field(
        default_factory=lambda: default_worker_id("scheduler-"),
        pattern=NAME_PATTERN,
        description="this scheduler's name in the lease; default: scheduler-<host>-<pid>",
    )
    steps_ahead: int = Field(
        default=2,
        ge=1,
        description="admission control: groups outstanding (admitted, not yet trained), in "
        "trainer steps; at most trainer.max_staleness + 1",
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
