"""What a simulated run measures as it goes, and the record it returns (``SimResult``)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from emulation.sim.engine import Engine
from emulation.sim.placement import Placement


@dataclass
class SimResult:
    """One simulated run. Rates are over the time to ``steps`` trainer steps."""

    arm: str
    devices: int
    trainer_devices: int
    steps: int
    staleness: int
    seed: int
    time_s: float
    samples_per_s: float
    tokens_per_s: float
    """Trained tokens per second."""
    generated_tokens_per_s: float
    steady_samples_per_s: float
    """Trained samples per second after the first quarter of the steps (start-up excluded)."""
    steady_tokens_per_s: float
    """Trained tokens per second over the same steps (``tokens_per_s`` counts the start-up's
    time: over ``steady_samples_per_s`` it is not a sample's length)."""
    steady_s_per_step: float
    """Seconds a step over the same steps (in ``drop`` mode a step may train fewer samples than
    a step's: it is not the samples of a step over ``steady_samples_per_s``)."""
    idle: dict[str, float]
    """Per pool (``train``: the trainer's devices, lent or not; ``rollout``, absent when empty;
    ``all``): the share of device time doing no work (waiting, switching, loading weights)."""
    mean_batch: float
    """Mean resident generations of a decoding engine."""
    staleness_mean: float
    staleness_p99: float
    staleness_max: int
    reclaim_p50_s: float
    reclaim_p99_s: float
    """Delay of a step from its batch being ready to its devices being reclaimed, over steps
    that waited for a reclaim (0 when none did)."""
    reclaims: int
    lends: int
    step_s_mean: float
    trainer_wait_s_mean: float
    """Mean time between a step's end and the next one's start: the trainer's idle window."""
    aborted_token_fraction: float
    """Generated tokens thrown away (stale samples dropped, aborts without a re-prefill)."""
    reprefill_token_fraction: float
    dropped_groups: int
    """Groups every sample of which was dropped as stale."""
    dropped_samples: int
    length_bias: float
    """Mean tokens of a trained sample over the mean of every sample whose fate was decided:
    trained, or dropped as stale (as ``bench/pipeline.py`` measures the emulated cluster).
    Groups still generating or waiting for their step when the run ends are in neither: their
    share is the run's end, not a bias (in a short run they are the long ones, and counting
    them put completion order's drops and the end of the run in one figure)."""
    trained_samples: int
    wall_s: float
    order: str = "completion"
    """Which groups the trainer stepped on (``emulation.sim.order.Order``)."""
    order_wait_s_per_step: float = 0.0
    """Seconds the trainer waited for earlier admitted groups, per step."""

    def to_dict(self) -> dict:
        return asdict(self)


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (the element at rank ``q * len``); 0 for none."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass(frozen=True)
class RunShape:
    """What a run was asked to do, as its result reports it."""

    arm: str
    devices: int
    trainer_devices: int
    steps: int
    staleness: int
    seed: int
    order: str


@dataclass
class Measurements:
    """A run's tallies, kept by the event loop as it goes."""

    trained_tokens: list[int] = field(default_factory=list)
    """Tokens of every trained sample."""
    step_tokens: list[int] = field(default_factory=list)
    """Tokens of every step's samples."""
    step_samples: list[int] = field(default_factory=list)
    """Per step: the samples it trained (in ``drop`` mode, fewer than a step's when some were
    stale)."""
    staleness: list[int] = field(default_factory=list)
    """Lag of every trained sample when trained."""
    reclaim_delays: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    order_waits: list[float] = field(default_factory=list)
    """Per step that waited for an earlier admitted group: how long."""
    computed_s: float = 0.0
    """Trainer time computing groups ahead of their step (``Order.OVERLAP``)."""
    generated: float = 0.0
    """Tokens of finished generations."""
    lost: float = 0.0
    """Tokens aborted without a re-prefill (generated, then thrown away)."""
    dropped_tokens: int = 0
    reprefilled: int = 0
    dropped: int = 0
    dropped_samples: int = 0
    lends: int = 0
    reclaims: int = 0

    def result(
        self, shape: RunShape, t: float, idle: dict[str, float], mean_batch: float, wall_s: float
    ) -> SimResult:
        """The run's record at time ``t``, when its last step ended."""
        generated = self.generated + self.lost
        steady_samples, steady_tokens, steady_step = self._steady_rates(shape, t)
        return SimResult(
            arm=shape.arm,
            devices=shape.devices,
            trainer_devices=shape.trainer_devices,
            steps=shape.steps,
            staleness=shape.staleness,
            seed=shape.seed,
            time_s=t,
            samples_per_s=len(self.trained_tokens) / t,
            tokens_per_s=sum(self.trained_tokens) / t,
            generated_tokens_per_s=generated / t,
            steady_samples_per_s=steady_samples,
            steady_tokens_per_s=steady_tokens,
            steady_s_per_step=steady_step,
            idle=idle,
            mean_batch=mean_batch,
            staleness_mean=statistics.fmean(self.staleness),
            staleness_p99=quantile(self.staleness, 0.99),
            staleness_max=max(self.staleness),
            reclaim_p50_s=quantile(self.reclaim_delays, 0.5),
            reclaim_p99_s=quantile(self.reclaim_delays, 0.99),
            reclaims=self.reclaims,
            lends=self.lends,
            step_s_mean=statistics.fmean(self.step_times),
            trainer_wait_s_mean=statistics.fmean(self.waits[1:] or self.waits),
            aborted_token_fraction=(self.dropped_tokens + self.lost) / generated,
            reprefill_token_fraction=self.reprefilled / generated,
            dropped_groups=self.dropped,
            dropped_samples=self.dropped_samples,
            length_bias=self._length_bias(),
            trained_samples=len(self.trained_tokens),
            wall_s=wall_s,
            order=shape.order,
            order_wait_s_per_step=sum(self.order_waits) / shape.steps,
        )

    def _length_bias(self) -> float:
        trained = sum(self.trained_tokens)
        decided = (trained + self.dropped_tokens) / (
            len(self.trained_tokens) + self.dropped_samples
        )
        return trained / len(self.trained_tokens) / decided

    def _steady_rates(self, shape: RunShape, t: float) -> tuple[float, float, float]:
        """Trained samples and tokens per second, and seconds a step, after the first quarter
        of the steps."""
        first = shape.steps // 4
        if first == 0 or first >= shape.steps:
            span, first = t, 0
        else:
            span = self.step_ends[-1] - self.step_ends[first - 1]
        steps = self.step_samples[first:]
        return sum(steps) / span, sum(self.step_tokens[first:]) / span, span / len(steps)


def idle_by_pool(
    engines: dict[str, Engine], placement: Placement, trained_s: float, t: float
) -> dict[str, float]:
    """``idle_share`` of the trainer's devices, the rollout ones (absent when none) and all."""
    trainers = set(placement.train_ids)
    rollout = list(placement.assignment.rollout)
    pools = {"train": placement.train_ids, "rollout": rollout, "all": placement.ids}
    return {
        pool: idle_share(engines, ids, trainers, trained_s, t) for pool, ids in pools.items() if ids
    }


def idle_share(
    engines: dict[str, Engine], ids: list[str], trainers: set[str], trained_s: float, t: float
) -> float:
    """The share of the time ``t`` that devices ``ids`` did no work: their engines decoding or
    prefilling count as work, and so does every step for a trainer device (``trained_s``)."""
    if not ids:
        return 0.0
    busy = sum(engines[w].busy_s for w in ids)
    busy += trained_s * sum(w in trainers for w in ids)
    return max(0.0, min(1.0, 1 - busy / (len(ids) * t)))


def mean_batch(engines: dict[str, Engine]) -> float:
    """Mean resident generations of a decoding engine, over every engine's decoding time."""
    decoding = sum(e.busy_s for e in engines.values())
    batch_s = sum(e.batch_s for e in engines.values())
    return batch_s / decoding if decoding else 0.0
