"""The control plane's messages between the scheduler and the workers: a worker's registry
entry (``WorkerRegistered``, with the trainer's shape admission reads) and role changes
(``RoleChangeRequested`` / ``RoleChangeAcked``). Apart from ``broker.messages`` (the data plane's
events) and ``broker.control`` (the scheduler's durable state); the same rules and encoding
(``broker.codec``), and top-level wire messages with exported schemas (``broker.schema``).
"""

from typing import Literal

from pydantic import BaseModel, Field

from broker.messages import (
    MAX_SAFE_INT,
    Id,
    Message,
    Role,
    RoleField,
    Timestamp,
    Version,
    WeightsState,
    WeightsStateField,
)


class TrainerShape(BaseModel):
    """What admission needs of a trainer's settings (``[trainer]``), as the trainer runs them."""

    model_config = Message.model_config

    groups_per_step: int = Field(ge=1, lt=MAX_SAFE_INT)
    max_staleness: int = Field(ge=0, lt=MAX_SAFE_INT)
    staleness_mode: Literal["drop", "downweight"] = "drop"
    overlap: bool = Field(
        default=False,
        description="computes a step ahead, a group as it completes (trainer.overlap): its "
        "workers are lent to rollout only where nobody else generates",
    )


def has_tags(worker_tags: list[str], wanted: list[str]) -> bool:
    """Whether tags ``worker_tags`` meet every tag in ``wanted``: ``key=value`` exactly, a bare
    ``key`` as itself or with any value (``gpu`` is met by ``gpu=0``)."""

    def met(tag: str) -> bool:
        if "=" in tag:
            return tag in worker_tags
        return any(t == tag or t.startswith(tag + "=") for t in worker_tags)

    return all(met(t) for t in wanted)


class WorkerRegistered(Message):
    """A worker's tags and state. # worker -> scheduler, as key ``<worker_id>`` of the
    ``sf-<run>-workers`` KV bucket, rewritten on every heartbeat."""

    worker_id: Id
    host: str = Field(min_length=1, max_length=256)
    pid: int = Field(ge=0, lt=MAX_SAFE_INT)
    tags: list[str] = Field(default_factory=list, max_length=64)
    role: RoleField = Role.IDLE
    epoch: int = Field(
        default=0, ge=0, lt=MAX_SAFE_INT, description="epoch of the last role change applied"
    )
    busy: bool = Field(default=False, description="working in its role right now")
    quarantined: bool = Field(
        default=False, description="a weight load overran its deadline: not serving until done"
    )
    weights: WeightsStateField = Field(
        default=WeightsState.READY,
        description="where it stands in the weight rhythm: ready, waiting (for its wave) or "
        "loading (engine paused); written as it changes",
    )
    wave: int | None = Field(
        default=None,
        ge=0,
        lt=MAX_SAFE_INT,
        description="its wave (0 first) at its last rolling load; none without weight_waves > 1",
    )
    capacity: int = Field(
        default=1, ge=1, lt=MAX_SAFE_INT, description="requests it generates at once as rollout"
    )
    version: Version | None = Field(default=None, description="weight version loaded, if any")
    metrics_url: str | None = Field(default=None, max_length=512)
    trainer: TrainerShape | None = Field(
        default=None, description="set by a worker holding the trainer: the scheduler admits by it"
    )
    trained_unacked: int = Field(
        default=0,
        ge=0,
        lt=MAX_SAFE_INT,
        description="trainer: samples its steps took (trained or dropped), held unacked until "
        "their checkpoint is durable; admission does not count them as outstanding",
    )
    order_waiting: int = Field(
        default=0,
        ge=0,
        lt=MAX_SAFE_INT,
        description="trainer: earlier admitted tasks its next step waits for (admission order); "
        "the scheduler counts them as missing groups, so a lendable trainer worker is lent to "
        "generate them",
    )
    started_at: Timestamp | None = Field(
        default=None, description="when this registration began: a new one re-admits it"
    )
    heartbeat_at: Timestamp


class RoleChangeRequested(Message):
    """Take this role. # scheduler -> worker, request on ``sf.<run>.ctl.role.<worker_id>``."""

    worker_id: Id
    role: RoleField
    epoch: int = Field(
        ge=1, lt=MAX_SAFE_INT, description="increases with every change; stale epochs are refused"
    )
    reason: str = Field(default="", max_length=1024)
    deadline_s: float = Field(
        default=30.0, gt=0, le=3600, description="ack within this, or be fenced"
    )
    expires_at: Timestamp = Field(
        description="on the worker's own clock (the one its heartbeat_at is read from): a "
        "request received after this is refused, a switch that ends after it is given back"
    )


class RoleChangeAcked(Message):
    """The outcome of a role change. # worker -> scheduler, reply to RoleChangeRequested."""

    worker_id: Id
    role: RoleField
    epoch: int = Field(ge=0, lt=MAX_SAFE_INT)
    ok: bool
    error: str | None = Field(default=None, max_length=4096)
