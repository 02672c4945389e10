"""Admission control at dispatch, for tasks from any client.

Clients publish tasks on ``sf.<run>.tasks``; only the active scheduler consumes them (durable
``scheduler``), and it moves a task to ``sf.<run>.tasks.admitted`` (durable ``agents``: the agent
runners) only while the run's outstanding work stays within the staleness bound:

    outstanding = admitted groups not yet finished (queued for or running on an agent runner)
                + ended sessions the trajectory manager has not built yet, in groups
                + samples the trainer has not settled, in groups
                  (less those its steps took, held unacked only until their checkpoint is
                  durable: its registry entry's ``trained_unacked``)
    limit       = steps_ahead * groups_per_step,  steps_ahead <= max_staleness + 1

``groups_per_step`` and ``max_staleness`` are the trainer's own, read off its registry entry by
the scheduler (``set_limit``); until it has them, nothing is admitted.

A group admitted when fewer than ``limit`` groups are outstanding has fewer than ``steps_ahead``
trainer steps ahead of it, so it is trained within the staleness bound: rollout is paced instead
of running ahead and having its finished work thrown away by the trainer's staleness drop (which
stays as a backstop, and counts what it drops). That holds only if the trainer takes groups in
the order they were admitted: in the order they finish, a long group, even started on the newest
weights, is overtaken by later short ones and is past the bound when it is done (``bench/pipeline.py
--stale drop`` dropped 64-80 samples per run so). So each admitted copy carries an ``Admitted``
stamp: a ticket (1, 2, ... for the run, stored in the scheduler's state before a task carries it)
and the oldest weight version a live worker held then (no token of the task is older). The
trainer waits, within a bound, for an earlier ticket before a step that would put it past the
staleness bound (``trainer.order``). Work of partial rollouts and
of lent workers is in these counts like any other. Every count is a broker consumer state
(durables ``agents``, ``trajectory``, ``trainer``, read in that order, so work moving downstream
between two reads is counted twice, never missed); nothing is asked of the other processes.

Sessions are counted in groups of the tasks' ``group_size`` (the agent runner ends one session
per attempt), samples in groups of as many samples as the trajectory manager has made per
session so far (samples stored / sessions delivered to it: a session with several leaves makes
several, one that yields none makes none). The first count left the manager's backlog out and
took one sample per session: sessions ended but not yet built counted as nothing
(``bench/pipeline.py --stale drop`` dropped 16 samples as stale in its synchronous arm, 0 since),
and a session with several leaves as several groups (``docs/agents.md`` saw a run stall).

Sessions of clients that drive the gateway themselves enter these counts when they end (their
``SessionEnded`` and samples are on the same streams); while they run they are outside the
bound: the scheduler cannot see them (``sf_gateway_calls_total{source="direct"}`` shows them).
"""

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from broker import codec
from broker.config import StreamLimits
from broker.ingress import Delivery, HandBack, Ingress, tasks_ingress
from broker.messages import Admitted, Role, TaskSubmitted, WeightsState
from broker.subjects import Durable, RunNames
from broker.worker_messages import WorkerRegistered
from common.log import kv
from tagsched.exceptions import AdmissionError, LeaseLostError
from tagsched.metrics import ADMISSION_WAIT, ADMITTED, LIMIT, OUTSTANDING, WAITING
from tagsched.state import StateStore

log = logging.getLogger(__name__)


def admission_limit(*, steps_ahead: int, groups_per_step: int, max_staleness: int) -> int:
    """Outstanding groups allowed; refuses a pace that would outrun the staleness bound."""
    if steps_ahead > max_staleness + 1:
        raise AdmissionError(
            f"scheduler.steps_ahead={steps_ahead} exceeds trainer.max_staleness + 1 = "
            f"{max_staleness + 1}: groups admitted that far ahead would be dropped as stale"
        )
    return steps_ahead * groups_per_step


@dataclass(frozen=True)
class AdmissionState:
    limit: int
    admitted: int
    """Admitted tasks not yet finished (each is one group)."""
    unsettled_groups: int
    """Samples the trainer has not settled, in groups (rounded up)."""
    groups_total: float = 0.0
    """Groups' worth of samples ever published to the trainer (it grows as rollout works)."""
    unbuilt_groups: int = 0
    """Ended sessions the trajectory manager has not built yet, in groups (rounded up)."""
    awaited_groups: int = 0
    """Earlier admitted tasks the trainer's next step waits for (its registry entry's
    ``order_waiting``): missing, however many later groups are complete."""

    @property
    def outstanding(self) -> int:
        return self.admitted + self.unbuilt_groups + self.unsettled_groups

    def missing_groups(self, groups_per_step: int) -> int:
        """Groups the trainer still lacks for its next batch (<= 0: a batch is ready)."""
        return max(groups_per_step - self.unsettled_groups, self.awaited_groups)

    @property
    def room(self) -> int:
        """Groups that may be admitted now."""
        return max(0, self.limit - self.outstanding)


def admission_state(
    agents: ConsumerInfo,
    trajectory: ConsumerInfo,
    trainer: ConsumerInfo,
    *,
    limit: int,
    group_size: float,
    trained: int = 0,
    awaited: int = 0,
) -> AdmissionState:
    """The state from the ``agents``, ``trajectory`` and ``trainer`` consumers' counts; a group is
    ``group_size`` sessions, each of the samples per session the trajectory manager made so far
    (1 until it has made any). ``trained`` of the trainer's unacked samples are trained already
    and held only until their checkpoint is durable: not unsettled. ``awaited``: the trainer's
    ``order_waiting``."""
    sessions_per_group = max(1.0, group_size)
    published = (trainer.delivered.stream_seq if trainer.delivered else 0) + (
        trainer.num_pending or 0
    )
    # Sessions handed to the manager, those it is building and redeliveries included: too few
    # samples per session if anything, so too many groups, never too few.
    sessions = trajectory.delivered.consumer_seq if trajectory.delivered else 0
    per_session = published / sessions if published and sessions else 1.0
    per_group = sessions_per_group * per_session
    return AdmissionState(
        limit,
        admitted=_unsettled(agents),
        unsettled_groups=_groups(max(0, _unsettled(trainer) - trained), per_group),
        unbuilt_groups=_groups(_unsettled(trajectory), sessions_per_group),
        groups_total=published / per_group,
        awaited_groups=awaited,
    )


def _unsettled(consumer: ConsumerInfo) -> int:
    """Messages the consumer has not settled: not yet delivered, or delivered and not acked."""
    return (consumer.num_pending or 0) + (consumer.num_ack_pending or 0)


def _groups(units: int, per_group: float) -> int:
    """``units`` in groups of ``per_group``, rounded up."""
    return math.ceil(units / per_group)


class Admission:
    """The scheduler's dispatcher: client tasks in, admitted tasks out, one at a time in order."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        tasks: StreamLimits,
        *,
        limit: int | None = None,
        poll_s: float = 0.25,
    ) -> None:
        self._js = js
        self._names = names
        self._tasks = tasks
        self._poll_s = poll_s
        self._group_sizes: deque[int] = deque(maxlen=64)  # of recent tasks, admitted or waiting
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._deposed: LeaseLostError | None = None
        self._stamp: Callable[[], Awaitable[Admitted]]
        self.trained_unacked = 0
        """The live trainer entries' ``trained_unacked``: samples held only until their
        checkpoint is durable (``trainer_counts`` sets it)."""
        self.order_waiting = 0
        """The live trainer entries' ``order_waiting`` (``trainer_counts`` sets it)."""
        self.set_limit(limit)

    def trainer_counts(self, trained_unacked: int, order_waiting: int) -> None:
        """The live trainers' counts, from the scheduler on each trainer entry it sees and each
        tick. When they change, a task waiting for room looks again at once, not at its next
        poll: a step's end is such a change (its samples trained, held until their checkpoint),
        and a lent worker waits for the work admitted then."""
        if (trained_unacked, order_waiting) != (self.trained_unacked, self.order_waiting):
            self.trained_unacked, self.order_waiting = trained_unacked, order_waiting
            self._changed.set()

    @property
    def group_sizes(self) -> list[int]:
        """The group sizes of recent tasks (what the counts take a group to be)."""
        return list(self._group_sizes)

    def recall(self, sizes: list[int]) -> None:
        """Count by ``sizes`` (a scheduler taking over: its predecessor's ``group_sizes``)."""
        self._group_sizes.clear()
        self._group_sizes.extend(sizes)

    def set_limit(self, limit: int | None) -> None:
        """Outstanding groups allowed from now on; None admits nothing."""
        self.limit = limit
        LIMIT.set(limit or 0)

    async def run(self, stop: asyncio.Event, stamp: Callable[[], Awaitable[Admitted]]) -> None:
        """Admit client tasks until ``stop``, each with its ``stamp()`` (its ticket, stored before
        it is handed out: the scheduler's ``Stamper``); a task waiting for room is handed back
        then. Raises ``LeaseLostError`` once the stamp finds this scheduler deposed: the task in
        hand is handed back once, for the next leader, and no other is taken (fetching on would
        spend each task's deliveries, ``max_deliver``, on refusals until the broker gave it up)."""
        self._stop = stop
        self._stamp = stamp
        self._deposed = None
        await self._ingress().run(stop)
        if self._deposed is not None:
            raise self._deposed

    def _ingress(self) -> Ingress[TaskSubmitted]:
        """Client tasks, validated (a bad one is dead-lettered as ``tasks``), one at a time."""
        return tasks_ingress(
            self._js,
            self._names,
            self._admit,
            self._tasks,
            durable=Durable.SCHEDULER,
            batch=1,
            concurrency=1,
            fetch_timeout=0.5,
        )

    async def state(self) -> AdmissionState:
        n = self._names
        # Upstream first: work moving on between two reads is counted twice, never missed.
        agents = await self._js.consumer_info(n.tasks_stream, Durable.AGENTS)
        trajectory = await self._js.consumer_info(n.traj_stream, Durable.TRAJECTORY)
        trainer = await self._js.consumer_info(n.samples_stream, Durable.TRAINER)
        sizes = self._group_sizes
        group_size = sum(sizes) / len(sizes) if sizes else 1.0
        limit = self.limit or 0
        trained = self.trained_unacked
        state = admission_state(
            agents,
            trajectory,
            trainer,
            limit=limit,
            group_size=group_size,
            trained=trained,
            awaited=self.order_waiting,
        )
        OUTSTANDING.set(state.outstanding)
        return state

    async def _admit(self, task: TaskSubmitted, delivery: Delivery) -> None:
        """Wait for room (the ingress keeps the message in progress meanwhile), then admit
        ``task``. The admitted copy is de-duplicated by its id, so a redelivery after a crash
        admits it once. Its group size counts at once: a scheduler that took over may know no other
        (its predecessor's are recalled from the run's state, when it wrote them), and counting
        sessions one per group would leave the trainer's groups no room."""
        self._group_sizes.append(task.group_size)
        WAITING.set(1)
        try:
            while (await self.state()).room <= 0:
                if self._stop.is_set():
                    raise HandBack("scheduler stopping")
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self._poll_s)
        finally:
            WAITING.set(0)
        try:
            stamp = await self._stamp()
        except LeaseLostError as exc:  # deposed: the task is the next leader's to admit
            self._deposed = exc
            self._stop.set()
            raise HandBack(f"scheduler deposed ({exc})") from exc
        await self._js.publish(
            self._names.tasks_admitted,
            codec.encode(task.model_copy(update={"admitted": stamp})),
            headers=codec.headers(msg_id=f"admitted-{task.task_id}"),
        )
        ADMITTED.inc()
        ADMISSION_WAIT.observe(max(0.0, time.time() - delivery.published_at))
        log.debug(kv("task_admitted", task=task.task_id, group_size=task.group_size, **dict(stamp)))


@dataclass
class Stamps:
    """Admission stamps in ticket order, pure: each names the first ticket stamped at its
    version (``Admitted.since``) since this ``Stamps`` began (a successor's starts afresh, so
    ``since`` never claims a ticket it did not stamp). The scheduler's ``Stamper`` and the
    cluster simulator stamp with it."""

    _since: tuple[int, int] | None = None  # the version last stamped, from which ticket

    def stamp(self, ticket: int, version: int, at: float | None = None) -> Admitted:
        if self._since is None or self._since[0] != version:
            self._since = (version, ticket)
        return Admitted(ticket=ticket, version=version, at=at, since=self._since[1])


class Stamper:
    """The scheduler's ``stamp`` for ``Admission.run``, from the run's state (``tagsched.state``:
    the tickets) and the scheduler's view of the registry: ``live``, its live workers, and
    ``entry_changed``, set on every registry entry it sees."""

    def __init__(
        self,
        store: StateStore,
        live: Callable[[], dict[str, WorkerRegistered]],
        entry_changed: asyncio.Event,
        wave_wait_s: float,
    ) -> None:
        self._store = store
        self._live = live
        self._entry_changed = entry_changed
        self._wave_wait_s = wave_wait_s
        self._stamps = Stamps()

    async def __call__(self) -> Admitted:
        """An admitted task's stamp: the next ticket, stored before the task carries it (a
        successor continues above it; ``LeaseLostError`` once deposed), and the oldest weight
        version a live rollout worker serves (the newest any worker holds while none serves).
        While workers load a new version (a step just ended: when admission finds room), the
        task waits up to ``wave_wait_s`` for them: it then starts on the newest version, and its
        stamp says so (a stamp below its tokens makes the trainer wait for it a step early:
        the stamp was 0.73 versions below in ``bench/pipeline.py``'s partial-rollout arm).
        The ticket and its version are taken together, so ``since`` (the first ticket this
        scheduler stamped at the version) is exact; a successor's first stamp starts it afresh."""
        deadline = time.monotonic() + self._wave_wait_s
        while self._loading() and (left := deadline - time.monotonic()) > 0:
            self._entry_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._entry_changed.wait(), left)
        ticket = self._store.state.tickets + 1
        live = [w for w in self._live().values() if w.version is not None]
        serving = [w.version for w in live if w.role is Role.ROLLOUT and not w.quarantined]
        version = min(serving) if serving else max((w.version for w in live), default=0)
        stamp = self._stamps.stamp(ticket, version)
        self._store.change(tickets=ticket)
        await self._store.flush()
        return stamp.model_copy(update={"at": time.time()})

    def _loading(self) -> bool:
        """Some live rollout worker has a newer weight version to load."""
        return any(
            w.role is Role.ROLLOUT and not w.quarantined and w.weights is not WeightsState.READY
            for w in self._live().values()
        )
