"""The tag scheduler: one active per run (``tagsched.lease``), it

1. admits client tasks within the staleness bound (``tagsched.admission``), by the shape the
   trainer registered (``WorkerRegistered.trainer``: its ``groups_per_step`` and
   ``max_staleness``); one that disagrees with the scheduler's own config, when it has one, is
   refused with an ERROR and nothing is admitted until they agree;
2. assigns roles to the live workers of the registry by the placement spec (``tagsched.spec``)
   and moves each worker whose role differs with ``RoleChangeRequested`` (a new epoch each) on
   ``sf.<run>.ctl.role.<worker_id>``; a worker that does not ack within the deadline is fenced:
   left out of every assignment (its role goes to another worker, its JetStream work is
   redelivered once it stops renewing it) until it shows a new registration;
3. lends the trainer's workers to rollout while the trainer waits for a batch, and reclaims
   them before the batch is ready (``tagsched.lending``).

What must outlive this scheduler (epochs, fences, measured switch costs, recent group sizes) is
in the run's state bucket (``tagsched.state``): a scheduler taking over claims it before it acts
and continues from it; a deposed one's next write fails, and it stops leading.

A worker is live while its registry entry was last written no longer than ``workers_ttl_s`` ago
on this scheduler's own clock (``broker.registry.LastSeen``: a heartbeat's arrival, never the
worker's ``heartbeat_at``, so a worker whose clock is off is judged like any other). The bucket
drops the entry soon after, but a watch is not told of expiry.
"""

import asyncio
import contextlib
import logging
import time
from collections import deque

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from broker import codec
from broker.control import Fence
from broker.exceptions import InvalidMessageError, RetryStoppedError
from broker.messages import Role, WeightsState
from broker.registry import LastSeen, watch_registry
from broker.retry import BACKOFF, TRANSIENT, retry
from broker.subjects import RunNames
from broker.worker_messages import (
    RoleChangeAcked,
    RoleChangeRequested,
    TrainerShape,
    WorkerRegistered,
)
from common.log import kv
from tagsched.admission import Admission, Stamper, admission_limit
from tagsched.config import SchedulerConfig
from tagsched.exceptions import (
    AdmissionError,
    LeaseLostError,
    SchedulerError,
    UnsatisfiableSpecError,
)
from tagsched.group import GroupRecord
from tagsched.lease import Lease
from tagsched.lending import LendingPolicy, RateMeter, trainer_roles
from tagsched.metrics import (
    ASSIGNED,
    CHANGES,
    FENCED,
    FENCED_NOW,
    LEADER,
    LEND_SECONDS,
    LENT,
    QUARANTINED,
    RECLAIM_SECONDS,
    REFUSED,
    UNSATISFIED,
    WEIGHTS,
)
from tagsched.spec import Assignment, PlacementSpec, assign
from tagsched.state import StateStore

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        nc: NATS,
        names: RunNames,
        config: SchedulerConfig,
        spec: PlacementSpec,
        admission: Admission,
        *,
        workers_ttl_s: float,
        lease_s: float,
        configured: TrainerShape | None = None,
    ) -> None:
        """``configured``: the trainer's shape as this scheduler's config has it, if it has one;
        a trainer registering another is refused."""
        self._nc = nc
        self._js = nc.jetstream()
        self._names = names
        self._config = config
        self._spec = spec
        self._admission = admission
        self._configured = configured
        self.trainer: TrainerShape | None = None  # the registered trainer's shape, once seen
        self._ttl = workers_ttl_s
        self._lease_s = lease_s
        self._workers: dict[str, WorkerRegistered] = {}
        self._entry_changed = asyncio.Event()  # set on every registry entry seen
        self._heard = LastSeen()  # when each worker's entry was last written, on our clock
        self._store: StateStore | None = None  # epochs and fences: set by run
        self._pending: dict[str, asyncio.Task] = {}  # role changes in flight, by worker
        self._lent: set[str] = set()  # trainer workers holding rollout: derived every tick
        self._policy = LendingPolicy(config.lend_gain, config.switch_cost_s)
        self._rate = RateMeter(config.rate_window_s)
        self._unsatisfied_since: float | None = None
        self._last_problem = ""
        self.assignment = Assignment()
        self._group = GroupRecord(self._js, names)  # the trainer group: tagsched.group

    @property
    def _fenced(self) -> dict[str, Fence]:
        """Fenced workers (a new registration re-admits each), by id."""
        return {} if self._store is None else {f.worker_id: f for f in self._store.state.fenced}

    def _unfence(self, worker_id: str) -> None:
        assert self._store is not None
        kept = [f for f in self._store.state.fenced if f.worker_id != worker_id]
        self._store.change(fenced=kept)

    # -- the lease ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, on_ready=lambda: None) -> None:
        """Stand by until this scheduler holds the lease, lead until it is lost or ``stop``."""
        scheduler_id = self._config.scheduler_id
        try:  # a broker restarting as the scheduler starts: wait for it, unless stopped
            lease = await retry(
                lambda: Lease.open(self._js, self._names, scheduler_id, self._lease_s),
                what="scheduler_lease_open",
                stop=stop,
            )
            self._store = await retry(
                lambda: StateStore.open(self._js, self._names, scheduler_id),
                what="scheduler_state_open",
                stop=stop,
            )
        except RetryStoppedError:
            return
        on_ready()
        while await lease.acquire(stop):
            LEADER.set(1)
            try:
                await self._lead(lease, stop)
            except LeaseLostError as exc:
                log.warning(kv("lease_lost", error=exc))
                continue
            finally:
                LEADER.set(0)
                await self._cancel_pending()
            with contextlib.suppress(NatsError):
                await lease.release()
            return

    async def _lead(self, lease: Lease, stop: asyncio.Event) -> None:
        log.info(kv("scheduler_leading", scheduler=self._config.scheduler_id))
        # What the scheduler before this one left: claimed before anything is done, so that its
        # next write fails.
        assert self._store is not None
        try:  # JetStream may be electing leaders: wait for it, unless stopped
            state = await retry(self._store.claim, what="scheduler_state_claim", stop=stop)
        except RetryStoppedError:
            return
        self._policy.lends = deque(state.lend_seconds, maxlen=self._policy.lends.maxlen)
        self._policy.reclaims = deque(state.reclaim_seconds, maxlen=self._policy.reclaims.maxlen)
        self._admission.recall(state.group_sizes)
        initial = asyncio.Event()
        watching = asyncio.create_task(self._watch(initial))
        admission_stop = asyncio.Event()
        stamp = Stamper(self._store, self.live, self._entry_changed, self._config.wave_wait_s)
        admitting = asyncio.create_task(self._admission.run(admission_stop, stamp))
        try:
            renewed, read = time.monotonic(), False
            while not stop.is_set():
                for task in (watching, admitting):
                    if task.done():
                        task.result()  # raises what stopped it
                        raise SchedulerError("a scheduler task ended unexpectedly")
                try:
                    if time.monotonic() - renewed >= lease.period:
                        await lease.renew()  # LeaseLostError once another holds it
                        renewed = time.monotonic()
                    # No tick before the registry's current entries are read, however long
                    # JetStream takes to serve them (leaders being elected): the lease is renewed
                    # meanwhile.
                    if not read and initial.is_set():
                        read = True
                        # Continue above every epoch handed out: stored, or (a state lost) in
                        # the registry.
                        epoch = max([state.epoch, *(w.epoch for w in self._workers.values())])
                        if epoch > state.epoch:
                            self._store.change(epoch=epoch)
                    if read:
                        await self._tick()
                except TRANSIENT as exc:  # a broker restart: the next tick tries again
                    log.warning(kv("scheduler_tick_failed", error=f"{type(exc).__name__}: {exc}"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._config.tick_s)
        finally:
            admission_stop.set()
            watching.cancel()
            await asyncio.gather(watching, admitting, return_exceptions=True)

    async def _watch(self, initial: asyncio.Event) -> None:
        """Follow the registry; a watch the broker dropped (a restart) is started again."""
        while True:
            try:
                async for sighting in watch_registry(self._js, self._names, on_current=initial.set):
                    self._heard.saw(sighting)
                    self._seen(sighting.worker_id, sighting.entry)
            except NatsError as exc:
                log.warning(kv("worker_watch_failed", error=exc))
            await asyncio.sleep(BACKOFF.max_s)

    def _seen(self, worker_id: str, entry: WorkerRegistered | None) -> None:
        fence = self._fenced.get(worker_id)
        if entry is None:
            self._workers.pop(worker_id, None)
            if fence is not None:  # gone: whatever comes back under its id is a new process
                self._unfence(worker_id)
            return
        if entry.trainer is not None:
            self._follow_trainer(worker_id, entry.trainer)
        known = self._workers.get(worker_id)
        if fence is not None and entry.started_at != fence.started_at:
            self._unfence(worker_id)  # a new registration: re-admitted
            log.info(kv("worker_readmitted", worker=worker_id))
        if known is not None and known.epoch > entry.epoch:
            # our own record is ahead (acked, not yet written back): keep its role and epoch
            entry = entry.model_copy(update={"role": known.role, "epoch": known.epoch})
        self._workers[worker_id] = entry
        self._entry_changed.set()
        if entry.trainer is not None:
            self._count_trainers(self.live())

    def _follow_trainer(self, worker_id: str, shape: TrainerShape) -> None:
        """Admit by the registered trainer's ``shape``, or admit nothing when it disagrees with
        this scheduler's config or cannot keep the staleness bound (an ERROR and a count, once
        per shape seen)."""
        if shape == self.trainer:
            return
        self.trainer = shape
        limit, reason, error = None, None, ""
        if self._configured is not None and shape != self._configured:
            reason = "mismatch"
            error = (
                f"trainer {worker_id} runs {_describe(shape)} but this scheduler's config has "
                f"{_describe(self._configured)}: admitting nothing until they agree"
            )
        else:
            try:
                limit = admission_limit(
                    steps_ahead=self._config.steps_ahead,
                    groups_per_step=shape.groups_per_step,
                    max_staleness=shape.max_staleness,
                )
            except AdmissionError as exc:
                reason, error = "staleness", f"trainer {worker_id}: {exc}: admitting nothing"
        self._admission.set_limit(limit)
        if reason is not None:
            REFUSED.labels(reason).inc()
            log.error(kv("admission_refused", reason=reason, error=error))
        else:
            log.info(kv("admission_limit", limit=limit, trainer=worker_id, **shape.model_dump()))

    # -- one tick -----------------------------------------------------------------------------
    def live(self) -> dict[str, WorkerRegistered]:
        """The workers whose entry was written within the TTL (on this scheduler's clock) and
        that are not fenced."""
        return {
            wid: w
            for wid, w in self._workers.items()
            if self._heard.fresh(wid, self._ttl) and wid not in self._fenced
        }

    def _count_trainers(self, live: dict[str, WorkerRegistered]) -> None:
        """Admission's counts from the ``live`` trainers' entries: on each tick (a trainer gone
        stale drops out) and on each trainer entry seen."""
        trainers = [w for w in live.values() if w.trainer is not None]
        self._admission.trainer_counts(
            sum(w.trained_unacked for w in trainers), sum(w.order_waiting for w in trainers)
        )

    async def _tick(self) -> None:
        assert self._store is not None
        if (sizes := self._admission.group_sizes) != self._store.state.group_sizes:
            self._store.change(group_sizes=sizes)
        # A fenced worker not heard of for the TTL is gone, or has given its role up by itself
        # (its lease is shorter) and re-registered: its fence has done its work.
        fenced = self._store.state.fenced
        kept = [f for f in fenced if self._heard.fresh(f.worker_id, self._ttl)]
        if len(kept) < len(fenced):
            self._store.change(fenced=kept)
        await self._store.flush()  # LeaseLostError once another scheduler wrote the state
        live = self.live()
        self._count_trainers(live)
        try:
            self.assignment = assign(self._spec, live, await self._group.members())
        except UnsatisfiableSpecError as exc:
            self._unsatisfied(str(exc))
            return
        self._unsatisfied_since = None
        UNSATISFIED.set(0)
        await self._group.follow(self.assignment.train)  # before any member is given train
        # A lend is a trainer worker holding rollout (its entry says so): no record of its own,
        # so a scheduler that took over continues the lends it finds.
        self._lent = {w for w in self.assignment.lendable if live[w].role is Role.ROLLOUT}
        state = await self._admission.state()
        rate = self._rate.update(time.monotonic(), state.groups_total)
        # No trainer registered yet: nothing to lend (as if its batch were ready).
        missing = state.missing_groups(self.trainer.groups_per_step) if self.trainer else 0
        desired = trainer_roles(
            self.assignment,
            self._policy,
            self._lent,
            missing_groups=missing,
            groups_per_s=rate,
            computes_ahead=self.trainer is not None and self.trainer.overlap,
        )
        for wid in self.assignment.rollout:
            desired[wid] = (Role.ROLLOUT, "rollout")
        for wid in self.assignment.idle:
            desired[wid] = (Role.IDLE, "not needed by the spec")
        for wid, (role, reason) in desired.items():
            if live[wid].role is not role and wid not in self._pending:
                self._pending[wid] = asyncio.create_task(self._change(wid, role, reason))
        self._show(live)

    def _unsatisfied(self, problem: str) -> None:
        UNSATISFIED.set(1)
        now = time.monotonic()
        if self._unsatisfied_since is None:
            self._unsatisfied_since = now
        if problem != self._last_problem:
            log.warning(kv("placement_unsatisfied", problem=problem))
            self._last_problem = problem
        if now - self._unsatisfied_since > self._config.placement_timeout_s:
            raise SchedulerError(
                f"placement spec unsatisfiable for {self._config.placement_timeout_s:g}s: {problem}"
            )

    def _show(self, live: dict[str, WorkerRegistered]) -> None:
        for role in Role:
            ASSIGNED.labels(role.value).set(sum(w.role is role for w in live.values()))
        for state in WeightsState:
            WEIGHTS.labels(state.value).set(sum(w.weights is state for w in live.values()))
        QUARANTINED.set(sum(w.quarantined for w in live.values()))
        LENT.set(len(self._lent))
        FENCED_NOW.set(len(self._fenced))

    # -- role changes -------------------------------------------------------------------------
    async def _change(self, worker_id: str, role: Role, reason: str) -> None:
        """Ask ``worker_id`` to take ``role``; fence it if it does not answer in time."""
        store = self._store
        assert store is not None
        try:
            entry = self._workers[worker_id]
            lending = role is Role.ROLLOUT and worker_id in self.assignment.lendable
            reclaiming = role is Role.TRAIN and worker_id in self._lent
            epoch = store.state.epoch + 1
            store.change(epoch=epoch)
            try:
                await store.flush()  # a successor continues above it, whatever happens next
            except (*TRANSIENT, LeaseLostError) as exc:  # the tick tries again, or stops leading
                log.warning(kv("role_change_deferred", worker=worker_id, error=exc))
                return
            deadline = self._config.role_change_deadline_s
            request = RoleChangeRequested(
                worker_id=worker_id,
                role=role,
                epoch=epoch,
                reason=reason[:1024],
                deadline_s=deadline,
                expires_at=self._expiry(worker_id, deadline),
            )
            started = time.monotonic()
            try:
                reply = await self._nc.request(
                    self._names.ctl_role(worker_id),
                    codec.encode(request),
                    timeout=self._config.role_change_deadline_s,
                )
                ack = codec.decode(RoleChangeAcked, reply.data)
            except (NatsTimeoutError, NoRespondersError, InvalidMessageError) as exc:
                self._fence(worker_id, entry, epoch, f"{type(exc).__name__}: {exc}")
                return
            seconds = time.monotonic() - started
            if not ack.ok:
                CHANGES.labels("refused").inc()
                if ack.epoch > store.state.epoch:  # a stale epoch: continue above it
                    store.change(epoch=ack.epoch)
                log.warning(kv("role_change_refused", worker=worker_id, error=ack.error))
                return
            CHANGES.labels("acked").inc()
            now = self._workers.get(worker_id, entry)
            self._workers[worker_id] = now.model_copy(update={"role": role, "epoch": ack.epoch})
            if lending:
                self._lent.add(worker_id)
                self._policy.lends.append(seconds)
                store.change(lend_seconds=list(self._policy.lends))
                LEND_SECONDS.observe(seconds)
            elif reclaiming:
                self._lent.discard(worker_id)
                self._policy.reclaims.append(seconds)
                store.change(reclaim_seconds=list(self._policy.reclaims))
                RECLAIM_SECONDS.observe(seconds)
            log.info(
                kv("role_assigned", worker=worker_id, role=role, epoch=ack.epoch, reason=reason)
            )
        finally:
            self._pending.pop(worker_id, None)

    def _expiry(self, worker_id: str, deadline: float) -> float:
        """When a request sent now expires, on the worker's own clock: its last heartbeat's
        ``heartbeat_at`` plus how long ago this scheduler saw that write (so, at or after the
        moment the worker stamped it), plus the deadline, less a tenth of it left for the ack's
        way back. No two clocks are compared: the worker reads it on the clock that stamped
        ``heartbeat_at``; the heartbeat's own way here only makes it earlier."""
        entry = self._workers[worker_id]
        return entry.heartbeat_at + (self._heard.age(worker_id) or 0.0) + 0.9 * deadline

    def _fence(self, worker_id: str, entry: WorkerRegistered, epoch: int, why: str) -> None:
        """Leave the worker out until it shows another registration, and say so in the state
        (written by the next tick): the worker reads it and gives its role up."""
        assert self._store is not None
        CHANGES.labels("timeout").inc()
        FENCED.inc()
        fence = Fence(worker_id=worker_id, started_at=entry.started_at, epoch=epoch)
        others = [f for f in self._store.state.fenced if f.worker_id != worker_id]
        self._store.change(fenced=[*others, fence])
        self._lent.discard(worker_id)
        log.warning(kv("worker_fenced", worker=worker_id, epoch=epoch, error=why))

    async def _cancel_pending(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()


def _describe(shape: TrainerShape) -> str:
    return (
        f"groups_per_step={shape.groups_per_step} max_staleness={shape.max_staleness} "
        f"staleness_mode={shape.staleness_mode} overlap={str(shape.overlap).lower()}"
    )
