"""When to lend the trainer's workers to rollout, and when to take them back (pure).

A trainer worker that also meets the rollout demand (multiplexed and colocated layouts) serves
rollout while the trainer would otherwise wait for a batch:

- **lend** only when the expected wait for the batch exceeds ``gain`` times the measured cost of
  a switch there and back (a rolling mean of recent switches; an assumed cost until measured);
- **reclaim** when the batch *will be* ready within the measured reclaim time, not when it is,
  so the trainer starts as the last group lands.

A trainer that computes a step ahead (``trainer.overlap``) is not idle while it waits for a
batch: it computes each group as it completes, and a lend stops that until the reclaim, after
which the groups that came meanwhile are computed with the batch complete. Its workers are lent
only where they are all the rollout there is (below). (Measured in the emulated cluster: lending
such a trainer cost 7-18% samples/s; docs/performance.md, "Lending a trainer that computes
ahead".)

Where the lent workers are all the rollout there is (a colocated layout whose every worker
trains), neither gate holds: the batch only grows while they generate, so they are lent
whenever a group is missing and reclaimed only once the batch is ready. (With the gates, a
reclaim ahead of the batch aborted the groups that were to complete it, and the trainer then
waited, with nobody generating, until the falling rate made a lend worth its cost again:
docs/performance.md, "The colocated layout in the simulator, and a lending bug it found".)

The wait is the missing groups over the rate groups have been arriving at (an exponential
moving average of the sample stream's growth).
"""

import math
from collections import deque
from dataclasses import dataclass, field

from broker.messages import Role
from tagsched.spec import Assignment


@dataclass
class LendingPolicy:
    gain: float
    assumed_cost_s: float
    lends: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    reclaims: deque[float] = field(default_factory=lambda: deque(maxlen=8))

    def reclaim_cost(self) -> float:
        return _mean(self.reclaims, self.assumed_cost_s / 2)

    def switch_cost(self) -> float:
        return _mean(self.lends, self.assumed_cost_s / 2) + self.reclaim_cost()

    def lent(self, *, now_lent: bool, missing_groups: float, groups_per_s: float) -> bool:
        """Whether the trainer worker should be lent (serving rollout) from now on."""
        if missing_groups <= 0:
            return False  # a batch is ready: train
        wait = missing_groups / groups_per_s if groups_per_s > 0 else math.inf
        if now_lent:
            return wait > self.reclaim_cost()
        return wait > self.gain * self.switch_cost()


@dataclass
class RateMeter:
    """Groups per second from a growing count, smoothed over about ``window_s``."""

    window_s: float = 5.0
    rate: float = 0.0
    _last: tuple[float, float] | None = None

    def update(self, now: float, count: float) -> float:
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            instant = max(0.0, count - self._last[1]) / dt
            alpha = 1 - math.exp(-dt / self.window_s)
            self.rate += alpha * (instant - self.rate)
        self._last = (now, count)
        return self.rate


def trainer_roles(
    assignment: Assignment,
    policy: LendingPolicy,
    lent: set[str],
    *,
    missing_groups: float,
    groups_per_s: float,
    computes_ahead: bool = False,
) -> dict[str, tuple[Role, str]]:
    """The role each trainer worker should hold now, with the reason: lent to rollout while
    the policy says so (lendable workers only; a trainer that ``computes_ahead`` only where
    they are all the rollout), training otherwise. ``lent``: the workers lent now. The
    scheduler's tick and the cluster simulator both decide with this."""
    desired: dict[str, tuple[Role, str]] = {}
    alone = not assignment.rollout  # no worker generates but those lent
    for wid in assignment.train:
        if wid not in assignment.lendable:
            lend = False
        elif alone:
            lend = missing_groups > 0
        elif computes_ahead:
            lend = False
        else:
            lend = policy.lent(
                now_lent=wid in lent, missing_groups=missing_groups, groups_per_s=groups_per_s
            )
        if lend:
            reason = f"lent: {missing_groups:g} group(s) missing, {groups_per_s:.2f}/s"
            desired[wid] = (Role.ROLLOUT, reason)
        else:
            desired[wid] = (Role.TRAIN, "train" if wid not in lent else "reclaimed")
    return desired


def _mean(values: deque[float], default: float) -> float:
    return sum(values) / len(values) if values else default
