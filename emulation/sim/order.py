"""The simulated trainer's choice of groups: which complete groups a step trains, and when it may
start (``Order``).

- ``completion`` (the simulator's trainer until issue 22): groups in the order they completed, a
  step as soon as ``groups_per_step`` are complete.
- ``admission`` (the real trainer: ``trainer.order``, ``trainer.batcher``): each group carries its
  admission stamp (a ticket and the oldest version a rollout engine served then; admission holds
  a task while engines load a new version, ``scheduler.wave_wait_s``). In ``drop`` mode a step
  waits for the missing tickets it would put past the bound, each at most ``order_wait_s``
  (``AdmissionOrder.blocking``: the trainer's own code, on simulated time); then it takes the
  complete groups with the oldest tokens (``Batcher.take``'s order).
- ``overlap`` (issue 22; the real trainer's ``trainer.overlap``): ``admission``, and while the
  trainer has nothing else to do it computes the gradients (the step's per-token work) of the oldest
  complete group within the bound, while fewer than a step's groups are computed or reserved for the
  missing tickets the step must take (``AdmissionOrder.due``: asking starts no wait). A computed
  group stays in its step: an older one that completes later goes to the next step, still within the
  bound. The step then computes only its groups not done yet, and its fixed part (optimizer, all-
  reduce). The step waits for an earlier ticket only once nothing is left to compute:
  ``order_wait_s`` bounds the trainer's idle wait, and the wait overlaps the step's compute.

In ``drop`` mode every order applies the real trainer's bound (``trainer.batcher.plan_step``) to
each sample of a group it takes: a sample whose oldest token lags past ``max_staleness`` is
dropped, the rest of its group trained. A step taken whole (``completion``, ``admission``) counts
every group it took, whatever it dropped, and trains fewer samples; a group computed ahead
(``overlap``) whose every sample was dropped takes no place in its step (``StepAhead.trained``).

The groups and samples the simulated cluster generates are here too (``_Group``, ``_Sample``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from broker.messages import Admitted
from common.staleness import StalenessMode, lag
from emulation.workload import AgentModel
from trainer.config import TrainerConfig
from trainer.order import AdmissionOrder

ORDER_WAIT_S: float = TrainerConfig.model_fields["order_wait_s"].default
"""The trainer's ``order_wait_s`` by default."""


class Order(StrEnum):
    """How the simulated trainer picks a step's groups (the module docstring)."""

    COMPLETION = "completion"
    ADMISSION = "admission"
    OVERLAP = "overlap"


@dataclass(frozen=True)
class TrainerOrder:
    """A real trainer's choice of groups in the simulator's terms (``of``: from its config's
    ``staleness_mode``, ``overlap`` and ``order_wait_s``; the defaults are the trainer's): its
    staleness mode, ``Order.OVERLAP`` where it computes ahead, else ``Order.ADMISSION``, and
    its bound on a step's wait for an earlier task."""

    stale: StalenessMode = TrainerConfig.model_fields["staleness_mode"].default
    order: Order = Order.ADMISSION
    wait_s: float = ORDER_WAIT_S

    @classmethod
    def of(cls, config: TrainerConfig) -> TrainerOrder:
        order = Order.OVERLAP if config.overlap else Order.ADMISSION
        return cls(config.staleness_mode, order, config.order_wait_s)

    def simulated(self) -> dict[str, Any]:
        """As ``emulation.sim.simulate``'s keywords."""
        return {"stale": self.stale, "order": self.order, "order_wait_s": self.wait_s}

    def __str__(self) -> str:
        return f"{self.stale} mode, {self.order} order, a step waits up to {self.wait_s:g} s"


@dataclass(eq=False)
class _Sample:
    group: _Group
    lengths: list[int]
    turn: int = 0
    tokens: int = 0
    versions: list[int] = field(default_factory=list)
    """The version of the engine each of its generations was placed on: its tokens are of these
    versions or newer ones (an engine loads weights under them), so its oldest is here."""
    agent: AgentModel = field(default_factory=AgentModel)
    """The agent of its workload's phase at admission (``Workload.at``)."""

    def lag(self, version: int) -> int:
        """Its oldest token's lag at trainer ``version`` (the trainer's rule)."""
        return lag(version, self.versions)


@dataclass(eq=False)
class _Group:
    gid: int
    samples: list[_Sample] = field(default_factory=list)
    done: int = 0
    stamp: Admitted | None = None
    """Its admission stamp (``Order.ADMISSION`` and ``OVERLAP``)."""

    def oldest(self) -> int:
        """Its oldest token's version (``Batcher.take`` steps on the oldest first)."""
        return min(min(s.versions) for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)


class Batches:
    """The trainer's complete groups, in ``order``: ``take`` a step's, ``compute`` ahead of it."""

    def __init__(
        self,
        order: Order,
        *,
        groups_per_step: int,
        staleness: int,
        stale: StalenessMode,
        order_wait_s: float,
    ) -> None:
        self.order = order
        self.groups_per_step = groups_per_step
        self.staleness = staleness
        self.stale = stale
        self.tickets = None if order is Order.COMPLETION else AdmissionOrder(order_wait_s)
        self.ready: list[_Group] = []
        """Complete, not computed: in the order they completed."""
        self.computed: list[_Group] = []
        """Their gradients computed at the trainer's current version (``overlap``)."""
        self.dropped = 0
        """Groups every sample of which was dropped as stale (``drop`` mode)."""
        self.dropped_samples = 0
        """Samples dropped as stale, and their tokens."""
        self.dropped_tokens = 0

    def __len__(self) -> int:
        return len(self.ready) + len(self.computed)

    def completed(self, group: _Group) -> None:
        self.ready.append(group)
        if self.tickets is not None and group.stamp is not None:
            self.tickets.completed(group.stamp)

    def blocking(self, version: int, now: float) -> float | None:
        """With a step's groups complete, in ``drop`` mode: when the trainer's wait for an
        earlier ticket runs out, if it is waiting for one (``AdmissionOrder.blocking``)."""
        if not self.awaited(version, now):
            return None
        assert self.tickets is not None
        return self.tickets.deadline()

    def awaited(self, version: int, now: float) -> int:
        """With a step's groups complete, in ``drop`` mode: how many earlier tickets the next
        step at ``version`` waits for (``AdmissionOrder.blocking``: it starts their waits and
        gives up those waited for too long), as the real trainer tells the scheduler while it
        trains, waits or is lent (``trainer.waits.OrderWait.refresh``, its ``order_waiting``);
        the lending gate counts them missing."""
        if self.tickets is None or self.stale is not StalenessMode.DROP:
            return 0
        if len(self) < self.groups_per_step:
            return 0
        return len(self.tickets.blocking(version, self.staleness, now))

    def _in_order(self, groups: list[_Group]) -> list[_Group]:
        if self.order is Order.COMPLETION:
            return groups
        return sorted(groups, key=lambda g: g.oldest())  # stable: of equals, the first complete

    def _plan(self, group: _Group, version: int) -> _Group:
        """``group`` as the trainer trains it at ``version``: its samples within the bound (all
        of them but in ``drop`` mode); the others counted dropped."""
        if self.stale is not StalenessMode.DROP:
            return group
        kept = [s for s in group.samples if s.lag(version) <= self.staleness]
        if len(kept) < len(group.samples):
            gone = [s for s in group.samples if s not in kept]
            self.dropped += not kept
            self.dropped_samples += len(gone)
            self.dropped_tokens += sum(s.tokens for s in gone)
        return _Group(group.gid, kept, group.done, group.stamp)

    def take(self, version: int) -> tuple[list[_Group], int] | None:
        """A step's groups at ``version``, as trained (``_plan``): those computed ahead, then the
        rest in order; and the tokens of those not computed ahead. None while fewer are
        complete. A step taken whole that would train nothing is skipped, as the trainer skips
        it (no new version): the next groups are taken."""
        while len(self) >= self.groups_per_step:
            if self.order is Order.OVERLAP:
                rest = self._ahead(version, self.groups_per_step - len(self.computed))
                if len(self.computed) + len(rest) < self.groups_per_step:
                    self.ready = rest + self.ready  # their stale samples gone; wait for more
                    return None
            else:
                taken = self._in_order(self.ready)[: self.groups_per_step]
                self.ready = [g for g in self.ready if g not in taken]
                rest = [self._plan(g, version) for g in taken]
            batch = self.computed + rest
            self.computed = []
            if any(g.samples for g in batch):
                return batch, sum(g.tokens for g in rest)
        return None

    def _ahead(self, version: int, n: int) -> list[_Group]:
        """``overlap``: up to ``n`` of the oldest complete groups as trained, taken from the
        complete ones; a group whose every sample is dropped takes no place."""
        planned: list[_Group] = []
        while self.ready and len(planned) < n:
            group = self._in_order(self.ready)[0]
            self.ready.remove(group)
            if (kept := self._plan(group, version)).samples:
                planned.append(kept)
        return planned

    def compute(self, version: int) -> _Group | None:
        """``overlap``: the next group to compute ahead, if any: the oldest complete one, while
        fewer than a step's groups are computed or reserved for the missing tickets the step
        must take (``AdmissionOrder.due``)."""
        if self.order is not Order.OVERLAP:
            return None
        missing = 0
        if self.tickets is not None and self.stale is StalenessMode.DROP:
            missing = len(self.tickets.due(version, self.staleness))
        if len(self.computed) + missing >= self.groups_per_step:
            return None
        ahead = self._ahead(version, 1)
        self.computed += ahead
        return ahead[0] if ahead else None
