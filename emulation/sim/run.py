"""Entry points: one simulated run, and the best static split by a sweep."""

from functools import lru_cache

from common.staleness import StalenessMode
from emulation.sim.cluster import Cluster
from emulation.sim.measure import SimResult
from emulation.sim.order import ORDER_WAIT_S, Order
from emulation.sim.placement import Arm
from emulation.sim.rhythm import Rhythm
from emulation.workload import Workload


def simulate(
    workload: Workload,
    arm: str,
    devices: int,
    steps: int,
    staleness: int,
    trainer_devices: int | None = None,
    *,
    waves: int = 1,
    stale: StalenessMode = StalenessMode.DROP,
    order: Order = Order.COMPLETION,
    order_wait_s: float = ORDER_WAIT_S,
    rhythm: Rhythm | None = None,
) -> SimResult:
    """Simulate ``steps`` trainer steps of ``arm`` on ``devices`` devices.

    ``trainer_devices``: the trainer's share (every device for ``sync_colocated``, whatever is
    given); None: the arm's own best split by a sweep (``best_split``; lending and partial
    rollout change which split is best). ``waves``: rolling weight-update waves. ``stale``:
    the trainer's staleness mode (drop stale groups, or train them downweighted). ``order``:
    which complete groups a step takes, and when (``emulation.sim.order``; the real trainer's
    is ``admission``); ``order_wait_s``: its bound on a step's wait for an earlier ticket.
    ``rhythm``: verl's admission and weight-sync rhythm instead of SeamlessFlow's
    (``emulation.sim.rhythm``; disaggregated arms).
    """
    kind = Arm(arm)
    if kind is Arm.SYNC_COLOCATED:
        trainer_devices = devices
    elif trainer_devices is None:
        trainer_devices = best_split(
            workload,
            devices,
            steps,
            staleness,
            arm=kind,
            waves=waves,
            stale=stale,
            order=order,
            order_wait_s=order_wait_s,
            rhythm=rhythm,
        )
    cluster = Cluster(
        workload,
        kind,
        devices=devices,
        trainer_devices=trainer_devices,
        steps=steps,
        staleness=staleness,
        waves=waves,
        stale=stale,
        order=Order(order),
        order_wait_s=order_wait_s,
        rhythm=rhythm,
    )
    return cluster.run()


def split_candidates(devices: int) -> list[int]:
    """Trainer device counts to try: every count up to half the cluster on small ones, about
    a dozen fractions (1/32 to 5/8) on large ones."""
    if devices <= 16:
        return list(range(1, max(2, devices // 2 + 1)))
    fractions = (1 / 32, 1 / 16, 1 / 10, 1 / 8, 3 / 16, 1 / 4, 5 / 16, 3 / 8, 1 / 2, 5 / 8)
    return sorted({min(devices - 1, max(1, round(devices * f))) for f in fractions})


@lru_cache(maxsize=256)
def best_split(
    workload: Workload,
    devices: int,
    steps: int,
    staleness: int,
    *,
    arm: Arm = Arm.DISAGGREGATED,
    waves: int = 1,
    stale: StalenessMode = StalenessMode.DROP,
    order: Order = Order.COMPLETION,
    order_wait_s: float = ORDER_WAIT_S,
    rhythm: Rhythm | None = None,
) -> int:
    """The trainer device count that trains the most samples a second over ``steps`` in
    ``arm`` (by default the static split a careful operator would tune), over
    ``split_candidates``, on the workload's seed. (Not the soonest to ``steps``: in ``drop`` mode
    a step trains fewer samples where more were stale.)"""
    rates = {
        k: simulate(
            workload,
            arm,
            devices,
            steps,
            staleness,
            k,
            waves=waves,
            stale=stale,
            order=order,
            order_wait_s=order_wait_s,
            rhythm=rhythm,
        ).samples_per_s
        for k in split_candidates(devices)
    }
    return max(rates, key=rates.__getitem__)
