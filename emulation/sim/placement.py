"""Which simulated device does what, per arm: the scheduler's own layout code (``spec.layout_spec``
and ``spec.assign``) on registrations built from device tags, and the waves the rollout side
loads new weights in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from broker.messages import Role
from broker.worker_messages import WorkerRegistered
from tagsched.spec import Assignment, Layout, assign, layout_spec


class Arm(StrEnum):
    """``sync_colocated``: synchronous, every device trains then generates (the baseline);
    ``colocated``: the real colocated layout (trainer devices lent while the batch is
    incomplete); the others as the layouts of the same names, ``partial_rollout`` the
    disaggregated layout with partial rollout (seamlessflow's)."""

    SYNC_COLOCATED = "sync_colocated"
    DISAGGREGATED = "disaggregated"
    PARTIAL_ROLLOUT = "partial_rollout"
    MULTIPLEXED = "multiplexed"
    COLOCATED = "colocated"


ARMS = tuple(Arm)

_LAYOUT = {
    Arm.SYNC_COLOCATED: Layout.COLOCATED,
    Arm.DISAGGREGATED: Layout.DISAGGREGATED,
    Arm.PARTIAL_ROLLOUT: Layout.DISAGGREGATED,
    Arm.MULTIPLEXED: Layout.MULTIPLEXED,
    Arm.COLOCATED: Layout.COLOCATED,
}


@dataclass(frozen=True)
class Placement:
    """The devices of one run (ids ``d0000``, ...) and what each does at the start."""

    assignment: Assignment
    ids: list[str]
    """Every device, sorted: device ``i`` is engine ``i``."""
    train_ids: list[str]
    serving: list[str]
    """The devices that generate at the start."""
    wave: dict[str, int]
    """Rollout device -> the weight-update wave it loads in (dealt round-robin by id)."""
    wave_members: list[list[str]]

    def roles(self) -> dict[str, Role]:
        """Every assigned device's role at the start (a fresh dict)."""
        roles = {wid: Role.TRAIN for wid in self.train_ids}
        roles.update((wid, Role.ROLLOUT) for wid in self.assignment.rollout)
        return roles


def place(arm: Arm, *, devices: int, trainer_devices: int, waves: int) -> Placement:
    """The spec's assignment of ``devices`` tagged devices, ``trainer_devices`` of them the
    trainer's."""
    if not 1 <= trainer_devices <= devices:
        raise ValueError(f"trainer_devices must be in [1, {devices}], got {trainer_devices}")
    if _LAYOUT[arm] is not Layout.COLOCATED and trainer_devices == devices:
        raise ValueError(f"{arm} needs a device for rollout besides the trainer's")
    workers = {}
    for i in range(devices):
        wid = f"d{i:04d}"
        workers[wid] = WorkerRegistered(
            worker_id=wid, host="sim", pid=0, tags=_tags(arm, i, trainer_devices), heartbeat_at=0.0
        )
    assignment = assign(layout_spec(_LAYOUT[arm], train_workers=trainer_devices), workers)
    train_ids = list(assignment.train)
    serving = list(assignment.rollout)
    if arm is Arm.SYNC_COLOCATED:
        serving += train_ids
    rollout = sorted(assignment.rollout)
    return Placement(
        assignment=assignment,
        ids=sorted(workers),
        train_ids=train_ids,
        serving=serving,
        wave={wid: i % waves for i, wid in enumerate(rollout)},
        wave_members=[rollout[w::waves] for w in range(waves)],
    )


def _tags(arm: Arm, i: int, trainer_devices: int) -> list[str]:
    if _LAYOUT[arm] is Layout.COLOCATED:
        return ["train", "rollout"]
    if i < trainer_devices:
        return ["train", "rollout"] if arm is Arm.MULTIPLEXED else ["train"]
    return ["rollout"]
