"""A simulated SeamlessFlow cluster, driven by the scheduler's own policy code.

What comes from ``tagsched`` (the code the real scheduler runs): who trains, who generates and
who may be lent (``spec.layout_spec`` + ``spec.assign`` on registrations built from device
tags), how many groups may be outstanding (``admission.admission_limit`` and
``AdmissionState.room``), and whether each trainer device is lent or reclaimed, once per
scheduler tick (``lending.trainer_roles`` with ``LendingPolicy`` fed the measured switch times,
and ``RateMeter`` on the groups published). Durations and lengths come from
``common.workload``. What is modelled here:

- **devices**: ``devices`` identical devices; a trainer step is data parallel over the
  trainer's devices (``TrainerCost.step_s(tokens, devices)``); an engine per device
  (``tagsched.sim.engine``);
- **agents**: an admitted group is ``group_size`` samples started at once; a sample is
  ``agent.turns`` generations with an environment latency between them; its lengths are drawn
  at admission from ``LengthModel.sample_group`` (per turn, for the group, at the trainer's
  version). Admission is immediate whenever the admission state has room;
- **routing**: a generation goes to the serving engine with the fewest residents that has a
  free slot (``max_batch``), else waits in one FIFO queue (re-placed generations go first);
- **trainer**: it trains when ``groups_per_step`` finished groups are waiting and all its
  devices are training (not lent, not switching), on the groups in the order they finished (the
  batcher's order). Its samples are settled (acked) when the step that trains them ends, as the
  real trainer does, so admission and the lending tick count them until then. Before a step, a
  group whose oldest token lags the trainer by more than the staleness bound is dropped and its
  tokens counted as aborted (the real batcher drops such samples one by one and trains the
  rest; dropping whole groups keeps every step at ``groups_per_step`` groups, so every arm
  trains the same samples). With ``StaleMode.DOWNWEIGHT`` (the trainer's ``downweight`` mode)
  stale groups are trained like the others, and their lag is in the staleness figures;
- **weights**: a step's new version is loaded by every serving engine in ``waves`` rolling
  waves (engines by id, dealt round-robin; a wave starts once every engine of an earlier wave
  serves the version: the rule of ``rollout.worker``'s ``_wait_for_wave``). Without partial
  rollout the wave's engines stop taking work and load together once all of them have drained
  (the sync barrier of a rollout side without partial rollout, as in verl's fully-async
  trainer); with it, each pauses its generations (KV kept), loads, and they continue on the new
  weights (what ``rollout.worker`` does);
- **lending** (multiplexed): a lend or a reclaim takes ``switch.warm_s``; a trainer device is
  not switched during a step. A reclaimed device aborts its generations, which continue on
  other engines after a re-prefill of their prefix (``switch.reprefill``) or start over;
- **sync colocated**: every device generates, then all train: the phases switch when the batch
  is complete (``warm_s``) and back after the step (``warm_s`` plus ``weight_sync_s``). It is
  synchronous, so its staleness bound is 0 whatever is asked and lending has no choice to make.
"""

from __future__ import annotations

import heapq
import random
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from broker.messages import Role, WorkerRegistered
from common.workload import Workload
from tagsched.admission import AdmissionState, admission_limit
from tagsched.config import SchedulerConfig
from tagsched.lending import LendingPolicy, RateMeter, trainer_roles
from tagsched.sim.engine import Engine, Generation, Loop
from tagsched.spec import Layout, assign, layout_spec


class Arm(StrEnum):
    SYNC_COLOCATED = "sync_colocated"
    DISAGGREGATED = "disaggregated"
    PARTIAL_ROLLOUT = "partial_rollout"
    MULTIPLEXED = "multiplexed"


ARMS = tuple(Arm)


class StaleMode(StrEnum):
    """The trainer's ``staleness_mode``: what a sample past the staleness bound gets."""

    DROP = "drop"
    DOWNWEIGHT = "downweight"


_LAYOUT = {
    Arm.SYNC_COLOCATED: Layout.COLOCATED,
    Arm.DISAGGREGATED: Layout.DISAGGREGATED,
    Arm.PARTIAL_ROLLOUT: Layout.DISAGGREGATED,
    Arm.MULTIPLEXED: Layout.MULTIPLEXED,
}


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
    """Generated tokens thrown away (stale groups dropped, aborts without a re-prefill)."""
    reprefill_token_fraction: float
    dropped_groups: int
    length_bias: float
    """Mean tokens of a trained sample over the mean drawn for every admitted sample."""
    trained_samples: int
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class _Sample:
    group: _Group
    lengths: list[int]
    turn: int = 0
    tokens: int = 0
    first_version: int | None = None


@dataclass(eq=False)
class _Group:
    gid: int
    samples: list[_Sample] = field(default_factory=list)
    done: int = 0

    def first_version(self) -> int:
        return min(s.first_version for s in self.samples)  # type: ignore[type-var]


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Cluster:
    """One simulated run of ``arm``: built from the workload and the split, then ``run()``."""

    def __init__(
        self,
        workload: Workload,
        arm: Arm,
        *,
        devices: int,
        trainer_devices: int,
        steps: int,
        staleness: int,
        waves: int = 1,
        stale: StaleMode = StaleMode.DROP,
    ) -> None:
        if not 1 <= trainer_devices <= devices:
            raise ValueError(f"trainer_devices must be in [1, {devices}], got {trainer_devices}")
        if arm is not Arm.SYNC_COLOCATED and trainer_devices == devices:
            raise ValueError(f"{arm} needs a device for rollout besides the trainer's")
        self.w = workload
        self.arm = arm
        self.steps = steps
        self.staleness = 0 if arm is Arm.SYNC_COLOCATED else staleness
        self.stale = stale
        self.partial = arm in (Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED)
        self.loop = Loop()
        self.rng = random.Random(workload.seed)
        self.config = SchedulerConfig(scheduler_id="sim")

        # 1. placement: the spec's assignment of tagged devices
        workers = {}
        for i in range(devices):
            wid = f"d{i:04d}"
            if arm is Arm.SYNC_COLOCATED:
                tags = ["train", "rollout"]
            elif i < trainer_devices:
                tags = ["train", "rollout"] if arm is Arm.MULTIPLEXED else ["train"]
            else:
                tags = ["rollout"]
            workers[wid] = WorkerRegistered(
                worker_id=wid, host="sim", pid=0, tags=tags, heartbeat_at=0.0
            )
        spec = layout_spec(_LAYOUT[arm], train_workers=trainer_devices)
        self.assignment = assign(spec, workers)
        ids = self.ids = sorted(workers)
        self.engines = {
            wid: Engine(i, workload.engine, self.loop, self._finished) for i, wid in enumerate(ids)
        }
        self.train_ids = list(self.assignment.train)
        self.role_train = set(self.train_ids)
        self.role = {wid: Role.TRAIN for wid in self.train_ids}
        for wid in self.assignment.rollout:
            self.role[wid] = Role.ROLLOUT
            self.engines[wid].serving = True
        if arm is Arm.SYNC_COLOCATED:
            for wid in self.train_ids:
                self.engines[wid].serving = True
        rollout = sorted(self.assignment.rollout)
        self.wave = {wid: i % waves for i, wid in enumerate(rollout)}
        self.wave_members = [rollout[w::waves] for w in range(waves)]
        self.wave_busy = [0] * waves  # members loading or draining

        # 2. admission and lending: the scheduler's policy objects
        self.limit = admission_limit(
            steps_ahead=self.staleness + 1,
            groups_per_step=workload.groups_per_step,
            max_staleness=self.staleness,
        )
        self.policy = LendingPolicy(self.config.lend_gain, self.config.switch_cost_s)
        self.rate = RateMeter(self.config.rate_window_s)
        self.lent: set[str] = set()
        self.switching: set[str] = set()

        # 3. state
        self.queue: deque[Generation] = deque()
        self.free_heap: list[tuple[int, str]] = []
        self.in_flight = 0  # admitted groups not finished
        self.ready: deque[_Group] = deque()
        self.published = 0
        self.version = 0
        self.training = False
        self.next_gid = 0
        self.loading: set[str] = set()
        self.draining: set[str] = set()
        self.batch_ready_at: float | None = None
        self.phase_switching = False  # sync colocated: generating -> training
        self.lent_since_step = False
        # measurements
        self.drawn_tokens: list[int] = []
        self.trained_tokens: list[int] = []
        self.staleness_seen: list[int] = []
        self.reclaim_delays: list[float] = []
        self.step_times: list[float] = []
        self.step_ends: list[float] = []
        self.waits: list[float] = []
        self.generated = 0.0  # tokens of finished generations
        self.lost = 0.0  # tokens aborted without a re-prefill (generated, then thrown away)
        self.dropped_tokens = 0
        self.reprefilled = 0
        self.dropped = 0
        self.n_lends = 0
        self.n_reclaims = 0

    # -- admission and agents ---------------------------------------------------------------
    def _admission(self) -> AdmissionState:
        """The broker's counts: a sample is settled once the step that trained it ends."""
        training = self.w.groups_per_step if self.training else 0
        unsettled = len(self.ready) + training
        return AdmissionState(self.limit, self.in_flight, unsettled, self.published)

    def _admit(self) -> None:
        for _ in range(self._admission().room):
            self._start_group()

    def _start_group(self) -> None:
        w = self.w
        per_turn = [
            w.lengths.sample_group(self.rng, w.group_size, self.version)
            for _ in range(w.agent.turns)
        ]
        group = _Group(self.next_gid)
        self.next_gid += 1
        self.in_flight += 1
        for i in range(w.group_size):
            sample = _Sample(group, [turn[i] for turn in per_turn])
            self.drawn_tokens.append(sum(sample.lengths))
            group.samples.append(sample)
            self._submit(Generation(sample, sample.lengths[0]))
        self._dispatch()

    def _submit(self, gen: Generation, front: bool = False) -> None:
        if front:
            self.queue.appendleft(gen)
        else:
            self.queue.append(gen)

    def _next_turn(self, sample: _Sample) -> None:
        self._submit(Generation(sample, sample.lengths[sample.turn]))
        self._dispatch()

    # -- routing ----------------------------------------------------------------------------
    def _offer(self, wid: str) -> None:
        e = self.engines[wid]
        if e.serving and e.free > 0:
            heapq.heappush(self.free_heap, (e.batch, wid))

    def _dispatch(self) -> None:
        while self.queue and self.free_heap:
            batch, wid = heapq.heappop(self.free_heap)
            e = self.engines[wid]
            if not e.serving or e.free <= 0 or e.batch != batch:
                continue
            gen = self.queue.popleft()
            if gen.sample.first_version is None:
                gen.sample.first_version = e.version
            prefix = int(gen.done)
            if prefix:
                self.reprefilled += prefix
            e.add(gen, prefix)
            self._offer(wid)

    def _serve(self, wid: str) -> None:
        self.engines[wid].serving = True
        self._offer(wid)
        self._dispatch()

    def _finished(self, engine: Engine, gens: list[Generation]) -> None:
        for gen in gens:
            self.generated += gen.length
            sample = gen.sample
            sample.tokens += gen.length
            sample.turn += 1
            if sample.turn < len(sample.lengths):
                self.loop.after(self.w.agent.latency_s(self.rng), self._next_turn, sample)
                continue
            group = sample.group
            group.done += 1
            if group.done == len(group.samples):
                self.in_flight -= 1
                self.ready.append(group)
                self.published += 1
        wid = self.ids[engine.eid]
        if wid in self.draining and not engine.residents:
            self._drained(self.wave[wid])
        self._offer(wid)
        self._dispatch()
        self._maybe_train()
        self._admit()

    # -- the trainer ------------------------------------------------------------------------
    def _trainer_free(self) -> bool:
        return all(self.role[w] is Role.TRAIN and w not in self.switching for w in self.train_ids)

    def _maybe_train(self) -> None:
        g = self.w.groups_per_step
        if self.training or len(self.ready) < g:
            return
        if self.batch_ready_at is None:
            self.batch_ready_at = self.loop.now
        if self.arm is Arm.SYNC_COLOCATED:
            if not self.phase_switching:
                self.phase_switching = True
                for wid in self.train_ids:
                    self.engines[wid].serving = False
                self.loop.after(self.w.switch.warm_s, self._colocated_train)
            return
        if not self._trainer_free():
            return
        batch = self._take_batch()
        if batch is None:
            self._admit()
            return
        if self.lent_since_step:
            self.reclaim_delays.append(self.loop.now - self.batch_ready_at)
        self.lent_since_step = False
        self._train(batch)

    def _take_batch(self) -> list[_Group] | None:
        """The first ``groups_per_step`` ready groups within the staleness bound; stale ones
        are dropped on the way (the trainer's backstop). None: not enough left."""
        fresh: list[_Group] = []
        kept: deque[_Group] = deque()
        while self.ready:
            group = self.ready.popleft()
            lag = self.version - group.first_version()
            if lag > self.staleness and self.stale is StaleMode.DROP:
                self.dropped += 1
                self.dropped_tokens += sum(s.tokens for s in group.samples)
                continue
            if len(fresh) < self.w.groups_per_step:
                fresh.append(group)
            else:
                kept.append(group)
        self.ready = kept
        if len(fresh) < self.w.groups_per_step:
            self.ready.extendleft(reversed(fresh))
            self.batch_ready_at = None
            return None
        return fresh

    def _train(self, batch: list[_Group]) -> None:
        self.waits.append(self.loop.now - (self.step_ends[-1] if self.step_ends else 0.0))
        self.training = True
        self.batch_ready_at = None
        tokens = 0
        for group in batch:
            for s in group.samples:
                tokens += s.tokens
                self.trained_tokens.append(s.tokens)
                self.staleness_seen.append(self.version - s.first_version)  # type: ignore[operator]
        seconds = self.w.trainer.step_s(tokens, len(self.train_ids))
        self.step_times.append(seconds)
        self.loop.after(seconds, self._trained)

    def _trained(self) -> None:
        self.training = False
        self.version += 1
        self.step_ends.append(self.loop.now)
        if self.version >= self.steps:
            self.loop.stop()
            return
        if self.arm is Arm.SYNC_COLOCATED:
            back = self.w.switch.warm_s + self.w.weight_sync_s
            self.loop.after(back, self._colocated_to_rollout)
            return
        self._update_weights()
        self._admit()
        self._maybe_train()

    # -- sync colocated ---------------------------------------------------------------------
    def _colocated_train(self) -> None:
        self.phase_switching = False
        batch = self._take_batch()
        assert batch is not None, "a synchronous batch is never stale"
        self._train(batch)

    def _colocated_to_rollout(self) -> None:
        for wid in self.train_ids:
            self.engines[wid].version = self.version
            self._serve(wid)
        self._admit()

    # -- weights ----------------------------------------------------------------------------
    def _update_weights(self) -> None:
        """Start loading the newest version, wave by wave: a wave starts once every engine of
        the waves before it serves it."""
        for w, members in enumerate(self.wave_members):
            behind = [wid for wid in members if self.engines[wid].version < self.version]
            for wid in behind:
                if wid in self.loading or wid in self.draining:
                    continue
                self.wave_busy[w] += 1
                if self.partial:
                    self._load(wid)
                else:
                    self.engines[wid].serving = False
                    self.draining.add(wid)
            if not self.partial:
                self._drained(w)
            if behind:
                return

    def _drained(self, w: int) -> None:
        """Without partial rollout, a wave loads once all its draining engines are empty (the
        rollout side's sync barrier: what is in flight finishes on the old weights)."""
        draining = [wid for wid in self.wave_members[w] if wid in self.draining]
        if any(self.engines[wid].residents for wid in draining):
            return
        for wid in draining:
            self.draining.discard(wid)
            self._load(wid)

    def _load(self, wid: str) -> None:
        e = self.engines[wid]
        e.serving = False
        self.loading.add(wid)
        e.stall(self.w.weight_sync_s)
        self.loop.after(self.w.weight_sync_s, self._loaded, wid, self.version)

    def _loaded(self, wid: str, version: int) -> None:
        self.loading.discard(wid)
        self.engines[wid].version = version
        self._serve(wid)
        w = self.wave[wid]
        self.wave_busy[w] -= 1
        if self.wave_busy[w] == 0:
            self._update_weights()

    # -- lending (the scheduler's tick) -----------------------------------------------------
    def _tick(self) -> None:
        rate = self.rate.update(self.loop.now, self.published)
        state = self._admission()
        desired = trainer_roles(
            self.assignment,
            self.policy,
            self.lent,
            missing_groups=state.missing_groups(self.w.groups_per_step),
            groups_per_s=rate,
        )
        for wid, (role, _) in desired.items():
            if self.role[wid] is role or wid in self.switching:
                continue
            if role is Role.ROLLOUT and not self.training:
                self._lend(wid)
            elif role is Role.TRAIN:
                self._reclaim(wid)
        self.loop.after(self.config.tick_s, self._tick)

    def _lend(self, wid: str) -> None:
        self.switching.add(wid)
        self.n_lends += 1
        self.loop.after(self.w.switch.warm_s, self._lent, wid)

    def _lent(self, wid: str) -> None:
        self.switching.discard(wid)
        self.role[wid] = Role.ROLLOUT
        self.lent.add(wid)
        self.policy.lends.append(self.w.switch.warm_s)
        self.engines[wid].version = self.version  # the trainer's own weights
        self.lent_since_step = True
        self._serve(wid)

    def _reclaim(self, wid: str) -> None:
        e = self.engines[wid]
        e.serving = False
        self.switching.add(wid)
        self.n_reclaims += 1
        for gen in reversed(e.abort_all()):
            if not self.w.switch.reprefill:
                self.lost += gen.done
                gen.done = 0.0
            self._submit(gen, front=True)
        self._dispatch()
        self.loop.after(self.w.switch.warm_s, self._reclaimed, wid)

    def _reclaimed(self, wid: str) -> None:
        self.switching.discard(wid)
        self.role[wid] = Role.TRAIN
        self.lent.discard(wid)
        self.policy.reclaims.append(self.w.switch.warm_s)
        self._maybe_train()

    # -- a run ------------------------------------------------------------------------------
    def run(self, max_time_s: float = 1e7) -> SimResult:
        started = time.perf_counter()
        for wid in self.engines:
            self._offer(wid)
        self._admit()
        if self.assignment.lendable and self.arm is Arm.MULTIPLEXED:
            self._tick()
        self.loop.run(max_time_s)
        if self.version < self.steps:
            raise RuntimeError(
                f"{self.arm}: {self.version}/{self.steps} steps after {self.loop.now:.0f}s"
            )
        return self._result(time.perf_counter() - started)

    def _result(self, wall_s: float) -> SimResult:
        t = self.loop.now
        trained_s = sum(self.step_times)  # each trainer device is busy for every step

        def idle(ids: list[str]) -> float:
            if not ids:
                return 0.0
            busy = sum(self.engines[w].busy_s for w in ids)
            busy += trained_s * sum(w in self.role_train for w in ids)
            return max(0.0, min(1.0, 1 - busy / (len(ids) * t)))

        rollout = list(self.assignment.rollout)
        decoding = sum(e.busy_s for e in self.engines.values())
        batch_s = sum(e.batch_s for e in self.engines.values())
        generated = self.generated + self.lost
        trained = sum(self.trained_tokens)
        return SimResult(
            arm=str(self.arm),
            devices=len(self.engines),
            trainer_devices=len(self.train_ids),
            steps=self.steps,
            staleness=self.staleness,
            seed=self.w.seed,
            time_s=t,
            samples_per_s=len(self.trained_tokens) / t,
            tokens_per_s=trained / t,
            generated_tokens_per_s=generated / t,
            steady_samples_per_s=self._steady_rate(),
            idle={
                "train": idle(self.train_ids),
                **({"rollout": idle(rollout)} if rollout else {}),
                "all": idle(self.ids),
            },
            mean_batch=batch_s / decoding if decoding else 0.0,
            staleness_mean=statistics.fmean(self.staleness_seen),
            staleness_p99=_quantile(self.staleness_seen, 0.99),
            staleness_max=max(self.staleness_seen),
            reclaim_p50_s=_quantile(self.reclaim_delays, 0.5),
            reclaim_p99_s=_quantile(self.reclaim_delays, 0.99),
            reclaims=self.n_reclaims,
            lends=self.n_lends,
            step_s_mean=statistics.fmean(self.step_times),
            trainer_wait_s_mean=statistics.fmean(self.waits[1:] or self.waits),
            aborted_token_fraction=(self.dropped_tokens + self.lost) / generated,
            reprefill_token_fraction=self.reprefilled / generated,
            dropped_groups=self.dropped,
            length_bias=statistics.fmean(self.trained_tokens) / statistics.fmean(self.drawn_tokens),
            trained_samples=len(self.trained_tokens),
            wall_s=wall_s,
        )

    def _steady_rate(self) -> float:
        first = self.steps // 4
        if first == 0 or first >= self.steps:
            return len(self.trained_tokens) / self.loop.now
        span = self.step_ends[-1] - self.step_ends[first - 1]
        return (self.steps - first) * self.w.samples_per_step / span
