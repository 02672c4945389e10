"""Admission order, pure Python (no NATS): which admitted tasks the trainer waits for before a
step, so that a long group is not overtaken past the staleness bound.

The scheduler stamps each admitted task with a ticket (1, 2, ... for the run) and the oldest
weight version a worker served then (``broker.messages.Admitted``); its samples carry the stamp.
Admission keeps fewer than ``(max_staleness + 1) * groups_per_step`` groups outstanding, so the
groups admitted before a task give the trainer at most ``max_staleness`` steps past the task's
version; a step beyond that needs a later ticket's group, and a later ticket shows the earlier one
missing. Before each step the trainer asks which missing tickets the step would put past the
bound: a ticket below the highest seen whose group has not completed, at its own version or, not
seen yet, at the version a later ticket's stamp gives it (``Admitted.since``: every ticket from
``since`` up to that one was stamped at its version), else at the version of the nearest ticket
below it (tickets are stamped in order, versions never fall). Without ``since`` a ticket not seen
yet (its samples come when its whole group is done) counted at the version before its own, and
a step waited for it a step early. It waits for those, each for at most ``wait_s`` from when it was
first waited for; then the ticket is given up (its task may have failed without samples) and
the step goes ahead.

A trainer that starts the run (at version 0) waits from ticket 1 on; one that resumes (from a
checkpoint, or as a new rank 0) waits only for tickets above the first one it sees: those below
may have been trained before it.

The trainer's wait itself, with its metrics: ``trainer.waits.OrderWait``.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from broker.messages import Admitted


@dataclass
class AdmissionOrder:
    wait_s: float
    from_start: Callable[[], bool] = lambda: True
    """Asked at the first ticket seen: whether this trainer starts the run (waits from ticket 1)."""
    _floor: int | None = None
    """Every ticket up to here has completed, was given up, or predates this trainer."""
    _floor_version: int = 0
    _versions: dict[int, int] = field(default_factory=dict)  # seen tickets above the floor
    _done: set[int] = field(default_factory=set)  # completed or given up, above the floor
    _since: dict[int, float] = field(default_factory=dict)  # waited for since (monotonic)
    given_up: int = 0

    def seen(self, admitted: Admitted) -> None:
        """A sample of ``admitted``'s task arrived (its group may still be filling)."""
        if self._floor is None:
            self._floor = 0 if self.from_start() else admitted.ticket - 1
            self._floor_version = 0 if self._floor == 0 else admitted.version
        first = admitted.ticket if admitted.since is None else admitted.since
        for ticket in range(max(first, self._floor + 1), admitted.ticket + 1):  # since: all at it
            self._versions.setdefault(ticket, admitted.version)

    def completed(self, admitted: Admitted) -> None:
        """A group of ``admitted``'s task is complete: nothing waits for it any more."""
        self.seen(admitted)
        self._finish(admitted.ticket)

    def due(self, version: int, max_staleness: int) -> list[int]:
        """The missing tickets a step at ``version`` would put past ``max_staleness``; asking
        starts no wait (``blocking`` does)."""
        if self._floor is None or not self._versions:
            return []
        late = version - max_staleness  # a task at this version or older must be in this step
        due: list[int] = []
        at = self._floor_version
        for ticket in range(self._floor + 1, max(self._versions) + 1):
            at = self._versions.get(ticket, at)
            if ticket not in self._done and at <= late:
                due.append(ticket)
        return due

    def blocking(self, version: int, max_staleness: int, now: float) -> list[int]:
        """``due``, once those waited for ``wait_s`` or longer (from the first time they were
        asked for here) are given up."""
        waiting: list[int] = []
        for ticket in self.due(version, max_staleness):
            if now - self._since.setdefault(ticket, now) >= self.wait_s:
                self.given_up += 1
                self._finish(ticket)
            else:
                waiting.append(ticket)
        return waiting

    def deadline(self) -> float | None:
        """When the longest wait under way runs out (monotonic), if any."""
        return min(self._since.values()) + self.wait_s if self._since else None

    def _finish(self, ticket: int) -> None:
        assert self._floor is not None
        if ticket <= self._floor:
            return
        self._done.add(ticket)
        self._since.pop(ticket, None)
        while self._floor + 1 in self._done:
            self._floor += 1
            self._done.discard(self._floor)
            self._floor_version = self._versions.pop(self._floor, self._floor_version)
