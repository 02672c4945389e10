"""Placement specs: role demands stated in tags, and the pure assignment of workers to roles.

A worker advertises capability tags (``train``, ``rollout``, ``gpu=0``, ``node=a``...). A demand
names the tags a worker must have: a bare ``key`` is met by the tag ``key`` or by any ``key=...``;
``key=value`` only by itself. The three layouts of a cluster are three specs of this one
mechanism:

- **colocated**: every worker is tagged both; one of them trains and, while the trainer waits
  for a batch, serves rollout like the others (time-shared);
- **disaggregated**: disjoint tags; trainer workers train, rollout workers generate;
- **multiplexed**: disaggregated, plus the trainer's workers are also tagged ``rollout`` and are
  lent to rollout while the sample backlog is below a batch.

A run's ``[layout]`` refines its kind's spec with the user's own tags and counts (``[layout.train]
tags = ["gpu=h200"]``: ``tagsched.config``); the tags a worker has come from its config and its
node (``broker.node_tags``: ``node=<host>``, ``gpu=<model>``).

Registered capacity (requests a worker generates at once) weights the choice where the rollout
demand takes fewer workers than match: the largest first, after those serving already (a worker
joining moves no one). It does not pick the trainer: a trainer worker lent to rollout is not
training at that moment, and capacity must not move the trainer to another worker then. Routing
is already in proportion to capacity: each rollout worker pulls from the generation queue only
as many requests as it has free slots.
"""

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from broker.worker_messages import WorkerRegistered, has_tags
from tagsched.exceptions import UnsatisfiableSpecError


class Layout(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    MULTIPLEXED = "multiplexed"


class Demand(BaseModel):
    """``count`` workers having every tag in ``tags`` (``count=None``: every such worker that
    is left, "the rest", at least one; ``0``: none, e.g. a cluster that only serves)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tags: list[str] = Field(min_length=1)
    count: int | None = Field(default=None, ge=0)


class PlacementSpec(BaseModel):
    """Who trains, who generates, and whether trainer workers are lent to rollout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train: Demand = Demand(tags=["train"], count=1)
    rollout: Demand = Demand(tags=["rollout"])
    lend: bool = Field(
        default=False,
        description="trainer workers that also meet the rollout demand serve rollout while the "
        "sample backlog is below a batch",
    )


def layout_spec(layout: Layout, train_workers: int = 1) -> PlacementSpec:
    """The spec of ``layout`` with ``train_workers`` workers training (data parallel)."""
    if layout is Layout.COLOCATED:
        train = Demand(tags=["train", "rollout"], count=train_workers)
        return PlacementSpec(train=train, lend=True)
    train = Demand(tags=["train"], count=train_workers)
    return PlacementSpec(train=train, lend=layout is Layout.MULTIPLEXED)


@dataclass(frozen=True)
class Assignment:
    train: list[str] = field(default_factory=list)
    rollout: list[str] = field(default_factory=list)
    """Workers that serve rollout all the time."""
    lendable: list[str] = field(default_factory=list)
    """Trainer workers that serve rollout while the trainer waits for a batch."""
    idle: list[str] = field(default_factory=list)


def assign(
    spec: PlacementSpec, workers: dict[str, WorkerRegistered], training: Collection[str] = ()
) -> Assignment:
    """Which live worker holds which role. Stable: a worker already training, or assigned to
    train before (``training``: the trainer group's members, a lent one among them while it
    serves rollout), keeps training. Raises ``UnsatisfiableSpecError`` naming what is missing."""
    able = sorted(
        (w for w in workers.values() if has_tags(w.tags, spec.train.tags)),
        # those training now or lent from training first (a lent member holds ``rollout``, and
        # moving the trainer away from it would re-form the group around another rank 0), then
        # those that cannot serve rollout (keep the versatile ones for it; by the demand, not
        # by counting tags: node and GPU tags would make a GPU-less worker look the most
        # dedicated), then by id
        key=lambda w: (
            w.role != "train" and w.worker_id not in training,
            has_tags(w.tags, spec.rollout.tags),
            w.worker_id,
        ),
    )
    wanted = spec.train.count if spec.train.count is not None else max(1, len(able))
    if len(able) < wanted:
        raise UnsatisfiableSpecError(
            f"train needs {wanted} worker(s) tagged {_tags(spec.train.tags)}; "
            f"{len(able)} of the live workers are: {_describe(workers, spec.train.tags)}"
        )
    train = [w.worker_id for w in able[:wanted]]
    rest = [w for w in workers.values() if w.worker_id not in train]
    serving = sorted(
        (w for w in rest if has_tags(w.tags, spec.rollout.tags)),
        # those serving now first, then the largest capacity, then by id
        key=lambda w: (w.role != "rollout", -w.capacity, w.worker_id),
    )
    if spec.rollout.count is not None:
        serving = serving[: spec.rollout.count]
    rollout = sorted(w.worker_id for w in serving)
    lendable = (
        [w for w in train if has_tags(workers[w].tags, spec.rollout.tags)] if spec.lend else []
    )
    needed = 1 if spec.rollout.count is None else spec.rollout.count
    if len(rollout) + len(lendable) < needed:
        raise UnsatisfiableSpecError(
            f"rollout needs {needed} worker(s) tagged {_tags(spec.rollout.tags)} besides the "
            f"trainer{' (or a lendable trainer worker)' if spec.lend else ''}; "
            f"live workers: {_describe(workers, spec.rollout.tags)}"
        )
    idle = sorted(w.worker_id for w in rest if w.worker_id not in rollout)
    return Assignment(train=train, rollout=rollout, lendable=lendable, idle=idle)


def _tags(tags: list[str]) -> str:
    return "{" + ",".join(tags) + "}"


def _describe(workers: dict[str, WorkerRegistered], wanted: list[str]) -> str:
    """Each live worker's tags, and the ``wanted`` ones it lacks."""
    if not workers:
        return "none"
    return ", ".join(
        f"{w.worker_id}{_tags(w.tags)}"
        + (f" lacks {_tags(lacking)}" if (lacking := _lacking(w.tags, wanted)) else "")
        for w in sorted(workers.values(), key=lambda w: w.worker_id)
    )


def _lacking(worker_tags: list[str], wanted: list[str]) -> list[str]:
    return [t for t in wanted if not has_tags(worker_tags, [t])]
