"""The control plane's durable state records, one per key of the run's state bucket
(``RunNames.state_kv``, ``sf-<run>-state``, no TTL; keys in ``docs/protocol.md`` section 7).

They are apart from ``broker.messages`` because they are not events on the data plane: each is
the current value of one key, rewritten by the one process that owns it (the scheduler holding
the lease, or the trainer group's rank 0) and read back by its successor and the workers, so it
is what must outlive the process that wrote it. They follow the same rules and encoding as every
message (``broker.codec``); ``SchedulerState`` is also a top-level wire message with an exported
schema (``broker.schema.WIRE_MESSAGES``).
"""

from pydantic import BaseModel, Field

from broker.messages import MAX_SAFE_INT, Count, Id, Message, Seconds, Timestamp


class Fence(BaseModel):
    """A worker the scheduler fenced: left out until it shows another registration."""

    model_config = Message.model_config

    worker_id: Id
    started_at: Timestamp | None = Field(description="the registration fenced")
    epoch: int = Field(ge=1, lt=MAX_SAFE_INT, description="the request it did not ack in time")


class SchedulerState(Message):
    """The scheduler's durable state. # the leading scheduler -> its successor and the workers,
    as key ``scheduler`` of the ``sf-<run>-state`` KV bucket, rewritten on every change with a
    compare-and-set on the revision it last wrote."""

    leader: Id = Field(description="the scheduler that wrote it")
    epoch: int = Field(
        default=0,
        ge=0,
        lt=MAX_SAFE_INT,
        description="the highest epoch handed out: stored before a request carries it",
    )
    fenced: list[Fence] = Field(default_factory=list, max_length=4096)
    lend_seconds: list[Seconds] = Field(
        default_factory=list, max_length=64, description="recent lends' switch times"
    )
    reclaim_seconds: list[Seconds] = Field(
        default_factory=list, max_length=64, description="recent reclaims' switch times"
    )
    group_sizes: list[Count] = Field(
        default_factory=list, max_length=256, description="recent tasks' group sizes"
    )
    tickets: Count = Field(
        default=0, description="the last admission ticket handed out, stored before a task has it"
    )

    def fence(self, worker_id: str) -> Fence | None:
        return next((f for f in self.fenced if f.worker_id == worker_id), None)


class TrainerGroup(Message):
    """The workers that train together, one data-parallel group: rank = index in ``members``,
    rank 0 takes the samples. # scheduler -> workers holding a trainer, as key
    ``trainer-group`` of the ``sf-<run>-state`` KV bucket, rewritten when the membership
    changes (a new ``generation`` each time)."""

    generation: int = Field(ge=1, lt=MAX_SAFE_INT)
    members: list[Id] = Field(max_length=4096)
    changed_at: Timestamp


class TrainerRendezvous(Message):
    """Where the members of one formation of the trainer group meet: rank 0's
    ``torch.distributed`` store. # rank 0 -> the other members, as key ``trainer-rendezvous``
    of the ``sf-<run>-state`` KV bucket; a new ``attempt`` each time rank 0 forms the group."""

    generation: int = Field(ge=1, lt=MAX_SAFE_INT)
    attempt: int = Field(ge=1, lt=MAX_SAFE_INT)
    members: list[Id] = Field(min_length=1, max_length=4096)
    host: str = Field(min_length=1, max_length=256)
    port: int = Field(ge=1, lt=65536)
