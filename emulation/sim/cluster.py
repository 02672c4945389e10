"""A simulated SeamlessFlow cluster, driven by the scheduler's own policy code.

What comes from ``tagsched`` (the code the real scheduler runs): who trains, who generates and
who may be lent (``spec.layout_spec`` + ``spec.assign`` on registrations built from device
tags), how many groups may be outstanding (``admission.admission_limit`` and
``AdmissionState.room``), and whether each trainer device is lent or reclaimed, once per
scheduler tick (``lending.trainer_roles`` with ``LendingPolicy`` fed the measured switch times,
and ``RateMeter`` on the groups published). Durations and lengths come from
``emulation.workload``. What is modelled here:

- **devices**: ``devices`` identical devices; a trainer step is data parallel over the
  trainer's devices (``TrainerCost.step_s(tokens, devices)``); an engine per device
  (``emulation.sim.engine``);
- **agents**: an admitted group is ``group_size`` samples started at once, each reaching its
  first generation ``agent.start_latency_s`` later; a sample is ``agent.turns`` generations with
  an environment latency between them; its lengths are drawn at admission from
  ``LengthModel.sample_group`` (per turn, for the group, at the trainer's version, seeded by
  ``Workload.draw_seed`` of its admission number and turn: every arm, and the emulated
  cluster's benchmark agent, draws the same lengths for the same group), the agent and lengths
  of the workload's phase at that version (``Workload.at``).
  Admission is immediate whenever the admission state has room;
- **routing**: a generation goes to the serving engine with the fewest residents that has a
  free slot (``max_batch``), else waits in one FIFO queue (re-placed generations go first);
- **admission stamps** (``Order.ADMISSION``, ``OVERLAP``): a group carries a ticket and the
  oldest version a rollout engine serves; admission holds while engines load a new version, up
  to ``scheduler.wave_wait_s`` (the scheduler's ``Stamper``);
- **trainer**: it trains when ``groups_per_step`` complete groups are waiting and all its
  devices are training (not lent, not switching), on the groups its ``Order`` picks
  (``emulation.sim.order``: today's real trainer is ``ADMISSION``). Its samples are settled
  (acked) when the step that trains them ends, as the real trainer does, so admission and the
  lending tick count them until then. In ``drop`` mode a sample whose oldest token lags the
  trainer by more than the staleness bound (``common.staleness.lag``, the trainer's rule) is
  dropped and its tokens counted as aborted; the rest of its group is trained, and a step taken
  whole trains fewer samples, as the real trainer's (``emulation.sim.order``). With
  ``StalenessMode.DOWNWEIGHT`` (the trainer's ``downweight`` mode) stale samples are trained like
  the others, and their lag is in the staleness figures;
- **weights**: a step's new version is loaded by every serving engine in ``waves`` rolling
  waves (engines by id, dealt round-robin; a wave starts once every engine of an earlier wave
  serves the version: the rule of ``rollout.following``'s ``_wait_for_wave``). Without partial
  rollout the wave's engines stop taking work and load together once all of them have drained
  (the sync barrier of a rollout side without partial rollout, as in verl's fully-async
  trainer); with it, each pauses its generations (KV kept), loads, and they continue on the new
  weights (what ``rollout.following`` does);
- **lending** (multiplexed and colocated; ``emulation.sim.lending``): a lend or a reclaim takes
  ``switch.warm_s``; a trainer device is not switched during a step. A reclaimed device aborts
  its generations, which continue on other engines after a re-prefill of their prefix
  (``switch.reprefill``) or start over;
- **verl's rhythm** (``rhythm``, disaggregated arms only): its rollouter's admission and a
  weight sync every ``sync_every`` steps replace the scheduler's admission and the update after
  every step (``emulation.sim.rhythm``);
- **colocated** (the real layout, ``[layout] kind = "colocated"``): every device is tagged
  both; ``trainer_devices`` of them train and are lent to rollout while the batch is
  incomplete, as the multiplexed trainer is, and the rest generate. Admission runs a step
  ahead (``staleness + 1`` steps), so the next step's groups generate in this step's tail and
  are interrupted at the reclaim, to continue (re-prefilled) after the step;
- **sync colocated** (verl-style synchronous training, the baseline): every device generates,
  then all train: the phases switch when the batch is complete (``warm_s``) and back after the
  step (``warm_s`` plus ``weight_sync_s``). A step's tasks are taken a step ahead (prompts
  prefetched, as the real colocated layout's admission a step ahead does): their agents' start
  latency runs during the step before. It is synchronous, so its staleness bound is 0 whatever
  is asked and lending has no choice to make.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque

from broker.messages import Admitted, Role
from common.staleness import StalenessMode, lag
from emulation.sim.engine import Engine, Generation, Loop
from emulation.sim.lending import Lending
from emulation.sim.measure import Measurements, RunShape, SimResult, idle_by_pool, mean_batch
from emulation.sim.order import ORDER_WAIT_S, Batches, Order, _Group, _Sample
from emulation.sim.placement import Arm, place
from emulation.sim.rhythm import Rhythm
from emulation.workload import AgentModel, Workload
from tagsched.admission import AdmissionState, Stamps, admission_limit
from tagsched.config import SchedulerConfig
from tagsched.lending import LendingPolicy, RateMeter


class Cluster(Lending):
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
        stale: StalenessMode = StalenessMode.DROP,
        order: Order = Order.COMPLETION,
        order_wait_s: float = ORDER_WAIT_S,
        rhythm: Rhythm | None = None,
    ) -> None:
        if rhythm is not None and arm not in (Arm.DISAGGREGATED, Arm.PARTIAL_ROLLOUT):
            raise ValueError(f"verl's rhythm is for the disaggregated arms, not {arm}")
        self.rhythm = rhythm
        self.window = 0  # with a rhythm: the groups its rollouter counts since the last sync
        self.placement = place(arm, devices=devices, trainer_devices=trainer_devices, waves=waves)
        self.w = workload
        self.arm = arm
        self.steps = steps
        self.staleness = 0 if arm is Arm.SYNC_COLOCATED else staleness
        self.partial = arm in (Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED, Arm.COLOCATED)
        self.loop = Loop()
        self.rng = random.Random(workload.seed)  # environment latencies
        self.start_rng = random.Random(workload.seed + 1)  # start latencies
        self.config = SchedulerConfig(scheduler_id="sim")
        self.m = Measurements()

        # 1. placement: the spec's assignment of tagged devices, an engine per device
        self.engines = {
            wid: Engine(i, workload.engine, self.loop, self._finished)
            for i, wid in enumerate(self.placement.ids)
        }
        for wid in self.placement.serving:
            self.engines[wid].serving = True
        self.role = self.placement.roles()
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
        self.batches = Batches(
            Order.COMPLETION if arm is Arm.SYNC_COLOCATED else order,
            groups_per_step=workload.groups_per_step,
            staleness=self.staleness,
            stale=stale,
            order_wait_s=order_wait_s,
        )
        self.held_since: float | None = None  # admission held while engines load (wave_wait_s)
        self.stamps = Stamps()  # the scheduler's stamps (``tagsched.admission``)
        self.computing = False  # overlap: a group's gradients ahead of its step
        self.blocked_since: float | None = None  # a step waiting for an earlier ticket
        self.wake_at: float | None = None
        self.published = 0
        self.version = 0
        self.training = False
        self.next_gid = 0
        self.loading: set[str] = set()
        self.draining: set[str] = set()
        self.batch_ready_at: float | None = None
        self.phase_switching = False  # sync colocated: generating -> training
        self.rollout_started_at = 0.0  # sync colocated: when the rollout phase began
        self.prefetched_at: float | None = None  # and the one before: a step ahead
        self.lent_since_step = False

    # -- admission and agents ---------------------------------------------------------------
    def _admission(self) -> AdmissionState:
        """The broker's counts: a sample is settled once the step that trained it ends; and the
        earlier tickets the trainer's next step waits for (its registry entry). Asking starts
        those waits (``Batches.awaited``), as the real trainer's count on each sample does:
        every finished generation calls ``_admit``, so a wait starts with the sample that
        completes a batch's worth, in every arm."""
        training = self.w.groups_per_step if self.training else 0
        unsettled = len(self.batches) + training
        awaited = self.batches.awaited(self.version, self.loop.now)
        return AdmissionState(
            self.limit, self.in_flight, unsettled, self.published, awaited_groups=awaited
        )

    def _admit(self) -> None:
        """With stamps, admission holds while a rollout engine has a newer version to load, up
        to ``wave_wait_s`` (the scheduler's ``Stamper``)."""
        if self.rhythm is not None:
            room = max(0, self.rhythm.budget(self.w.groups_per_step) - self.window)
            self.window += room
            for _ in range(room):
                self._start_group()
            return
        room = self._admission().room
        wait_s = self.config.wave_wait_s
        if room and self.batches.tickets is not None and self._loading():
            if self.held_since is None:
                self.held_since = self.loop.now
                self.loop.after(wait_s, self._admit)
            if self.loop.now - self.held_since < wait_s:
                return
        self.held_since = None
        for _ in range(room):
            self._start_group()

    def _loading(self) -> bool:
        return any(self.engines[w].version < self.version for w in self.placement.wave)

    def _stamp(self, gid: int) -> Admitted:
        """The scheduler's stamp: the ticket, the oldest version a rollout engine serves, and
        the first ticket stamped at that version."""
        served = [self.engines[w].version for w, r in self.role.items() if r is Role.ROLLOUT]
        return self.stamps.stamp(gid + 1, min(served, default=self.version))

    def _start_group(self) -> None:
        w = self.w.at(self.version)
        per_turn = [
            w.lengths.sample_group(
                random.Random(w.draw_seed(self.next_gid, turn)), w.group_size, self.version
            )
            for turn in range(w.agent.turns)
        ]
        group = _Group(self.next_gid)
        if self.batches.tickets is not None:
            group.stamp = self._stamp(group.gid)
        self.next_gid += 1
        self.in_flight += 1
        for i in range(w.group_size):
            sample = _Sample(group, [turn[i] for turn in per_turn], agent=w.agent)
            group.samples.append(sample)
            if w.agent.start_latency_s:
                self.loop.after(self._start_latency(w.agent), self._next_turn, sample)
            else:
                self._submit(Generation(sample, sample.lengths[0]))
        self._dispatch()

    def _start_latency(self, agent: AgentModel) -> float:
        """Seconds from admission to the sample's first generation. Synchronous colocated
        training takes a step's tasks a step ahead (prompts prefetched, as the real colocated
        layout's ``steps_ahead`` 2 does): only what is left of their start latency after the
        step before it delays them."""
        latency = agent.start_s(self.start_rng)
        if self.arm is Arm.SYNC_COLOCATED and self.prefetched_at is not None:
            return max(0.0, latency - (self.loop.now - self.prefetched_at))
        return latency

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
            gen.sample.versions.append(e.version)
            prefix = int(gen.done)
            if prefix:
                self.m.reprefilled += prefix
            e.add(gen, prefix)
            self._offer(wid)

    def _serve(self, wid: str) -> None:
        self.engines[wid].serving = True
        self._offer(wid)
        self._dispatch()

    def _finished(self, engine: Engine, gens: list[Generation]) -> None:
        for gen in gens:
            self.m.generated += gen.length
            sample = gen.sample
            sample.tokens += gen.length
            sample.turn += 1
            if sample.turn < len(sample.lengths):
                self.loop.after(sample.agent.latency_s(self.rng), self._next_turn, sample)
                continue
            group = sample.group
            group.done += 1
            # the agent runner publishes a group's sessions together: the trainer sees its
            # ticket when the group completes (``rollout.agents.runner``)
            if group.done == len(group.samples):
                self.in_flight -= 1
                self.batches.completed(group)
                self.published += 1
        wid = self.placement.ids[engine.eid]
        if wid in self.draining and not engine.residents:
            self._drained(self.placement.wave[wid])
        self._offer(wid)
        self._dispatch()
        self._maybe_train()
        self._admit()

    # -- the trainer ------------------------------------------------------------------------
    def _trainer_free(self) -> bool:
        return all(
            self.role[w] is Role.TRAIN and w not in self.switching for w in self.placement.train_ids
        )

    def _maybe_train(self) -> None:
        if self.training or self.computing or self._compute_ahead():
            return
        if len(self.batches) < self.w.groups_per_step:
            return
        if self.batch_ready_at is None:
            self.batch_ready_at = self.loop.now
        if self.arm is Arm.SYNC_COLOCATED:
            if not self.phase_switching:
                self.phase_switching = True
                for wid in self.placement.train_ids:
                    self.engines[wid].serving = False
                self.loop.after(self.w.switch.warm_s, self._colocated_train)
            return
        if not self._trainer_free():
            return
        deadline = self.batches.blocking(self.version, self.loop.now)
        if deadline is not None:  # an earlier ticket the step would put past the bound
            if self.blocked_since is None:
                self.blocked_since = self.loop.now
            if deadline != self.wake_at:
                self.wake_at = deadline
                self.loop.at(deadline, self._maybe_train)
            return
        taken = self.batches.take(self.version)
        if taken is None:
            self.batch_ready_at = None
            self._admit()
            return
        if self.lent_since_step:
            self.m.reclaim_delays.append(self.loop.now - self.batch_ready_at)
        self.lent_since_step = False
        self._train(*taken)

    def _compute_ahead(self) -> bool:
        """``overlap``: start computing the next complete group's gradients ahead of its step,
        if there is one. Returns whether it started."""
        if self.batches.order is not Order.OVERLAP or not self._trainer_free():
            return False
        group = self.batches.compute(self.version)
        if group is None:
            return False
        self.computing = True
        seconds = self.w.trainer.s_per_token * group.tokens / len(self.placement.train_ids)
        self.m.computed_s += seconds
        self.loop.after(seconds, self._computed)
        return True

    def _computed(self) -> None:
        self.computing = False
        self._maybe_train()

    def _train(self, batch: list[_Group], tokens: int) -> None:
        """A step on ``batch``, ``tokens`` of whose tokens were not computed ahead."""
        self.m.waits.append(self.loop.now - (self.m.step_ends[-1] if self.m.step_ends else 0.0))
        if self.blocked_since is not None:
            self.m.order_waits.append(self.loop.now - self.blocked_since)
            self.blocked_since = None
        self.training = True
        self.batch_ready_at = None
        for group in batch:
            for s in group.samples:
                self.m.trained_tokens.append(s.tokens)
                self.m.staleness.append(lag(self.version, s.versions))
        self.m.step_tokens.append(sum(s.tokens for group in batch for s in group.samples))
        self.m.step_samples.append(sum(len(group.samples) for group in batch))
        seconds = self.w.trainer.step_s(tokens, len(self.placement.train_ids))
        self.m.step_times.append(seconds)
        self.loop.after(seconds, self._trained)

    def _trained(self) -> None:
        self.training = False
        self.version += 1
        self.m.step_ends.append(self.loop.now)
        if self.version >= self.steps:
            self.loop.stop()
            return
        if self.arm is Arm.SYNC_COLOCATED:
            back = self.w.switch.warm_s + self.w.weight_sync_s
            self.loop.after(back, self._colocated_to_rollout)
            return
        if self.rhythm is None:
            self._update_weights()
        elif self.rhythm.syncs(self.version):
            self._update_weights()
            self.window = self.in_flight + len(self.batches)
        self._admit()
        self._maybe_train()

    # -- sync colocated ---------------------------------------------------------------------
    def _colocated_train(self) -> None:
        self.phase_switching = False
        taken = self.batches.take(self.version)
        assert taken is not None, "a synchronous batch is never stale"
        self._train(*taken)

    def _colocated_to_rollout(self) -> None:
        self.prefetched_at, self.rollout_started_at = self.rollout_started_at, self.loop.now
        for wid in self.placement.train_ids:
            self.engines[wid].version = self.version
            self._serve(wid)
        self._admit()

    # -- weights ----------------------------------------------------------------------------
    def _update_weights(self) -> None:
        """Start loading the newest version, wave by wave: a wave starts once every engine of
        the waves before it serves it."""
        for w, members in enumerate(self.placement.wave_members):
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
        draining = [wid for wid in self.placement.wave_members[w] if wid in self.draining]
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
        if self.held_since is not None:
            self._admit()
        w = self.placement.wave[wid]
        self.wave_busy[w] -= 1
        if self.wave_busy[w] == 0:
            self._update_weights()

    # -- a run ------------------------------------------------------------------------------
    def run(self, max_time_s: float = 1e7) -> SimResult:
        started = time.perf_counter()
        for wid in self.engines:
            self._offer(wid)
        self._admit()
        if self.placement.assignment.lendable and self.arm in (Arm.MULTIPLEXED, Arm.COLOCATED):
            self._tick()
        self.loop.run(max_time_s)
        if self.version < self.steps:
            raise RuntimeError(
                f"{self.arm}: {self.version}/{self.steps} steps after {self.loop.now:.0f}s"
            )
        return self._result(time.perf_counter() - started)

    def _result(self, wall_s: float) -> SimResult:
        t = self.loop.now
        self.m.dropped, self.m.dropped_tokens = self.batches.dropped, self.batches.dropped_tokens
        self.m.dropped_samples = self.batches.dropped_samples
        # each trainer device is busy for every step and every group computed ahead
        trained_s = sum(self.m.step_times) + self.m.computed_s
        idle = idle_by_pool(self.engines, self.placement, trained_s, t)
        shape = RunShape(
            arm=str(self.arm),
            devices=len(self.engines),
            trainer_devices=len(self.placement.train_ids),
            steps=self.steps,
            staleness=self.staleness,
            seed=self.w.seed,
            order=str(self.batches.order),
        )
        return self.m.result(shape, t, idle, mean_batch(self.engines), wall_s)
