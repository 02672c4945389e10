"""Admission control at dispatch, for tasks from any client.

Clients publish tasks on ``sf.<run>.tasks``; only the active scheduler consumes them (durable
``scheduler``), and it moves a task to ``sf.<run>.tasks.admitted`` (durable ``agents``: the agent
runners) only while the run's outstanding work stays within the staleness bound:

    outstanding = admitted groups not yet finished (queued for or running on an agent runner)
                + samples the trainer has not settled, counted in groups
    limit       = steps_ahead * groups_per_step,  steps_ahead <= max_staleness + 1

``groups_per_step`` and ``max_staleness`` are the trainer's own, read off its registry entry by
the scheduler (``set_limit``); until it has them, nothing is admitted.

A group admitted when fewer than ``limit`` groups are outstanding has fewer than ``steps_ahead``
trainer steps ahead of it, so it is trained within the staleness bound: rollout is paced instead
of running ahead and having its finished work thrown away by the trainer's staleness drop (which
stays as a backstop, and counts what it drops). Work of partial rollouts and of lent workers is
in these counts like any other. Both counts are the broker's consumer states; nothing is asked
of the other processes.
"""

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from broker import codec
from broker.config import StreamLimits
from broker.ingress import Delivery, HandBack, Ingress, tasks_ingress
from broker.messages import TaskSubmitted
from broker.subjects import Durable, RunNames
from common.log import kv
from tagsched.exceptions import AdmissionError
from tagsched.metrics import ADMISSION_WAIT, ADMITTED, LIMIT, OUTSTANDING, WAITING

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

    @property
    def outstanding(self) -> int:
        return self.admitted + self.unsettled_groups

    def missing_groups(self, groups_per_step: int) -> int:
        """Groups the trainer still lacks for its next batch (<= 0: a batch is ready)."""
        return groups_per_step - self.unsettled_groups

    @property
    def room(self) -> int:
        """Groups that may be admitted now."""
        return max(0, self.limit - self.outstanding)


def admission_state(
    agents: ConsumerInfo, trainer: ConsumerInfo, *, limit: int, samples_per_group: float
) -> AdmissionState:
    """The state from the ``agents`` and ``trainer`` consumers' counts."""
    per_group = max(1, round(samples_per_group))
    unsettled = (trainer.num_pending or 0) + (trainer.num_ack_pending or 0)
    groups = -(-unsettled // per_group)  # ceiling
    admitted = (agents.num_pending or 0) + (agents.num_ack_pending or 0)
    published = (trainer.delivered.stream_seq if trainer.delivered else 0) + (
        trainer.num_pending or 0
    )
    return AdmissionState(limit, admitted, groups, published / per_group)


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
        self._group_sizes: deque[int] = deque(maxlen=64)  # of recently admitted tasks
        self._stop = asyncio.Event()
        self.set_limit(limit)

    def set_limit(self, limit: int | None) -> None:
        """Outstanding groups allowed from now on; None admits nothing."""
        self.limit = limit
        LIMIT.set(limit or 0)

    async def run(self, stop: asyncio.Event) -> None:
        """Admit client tasks until ``stop``; a task waiting for room is handed back then."""
        self._stop = stop
        await self._ingress().run(stop)

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
        agents = await self._js.consumer_info(n.tasks_stream, Durable.AGENTS)
        trainer = await self._js.consumer_info(n.samples_stream, Durable.TRAINER)
        sizes = self._group_sizes
        per_group = sum(sizes) / len(sizes) if sizes else 1.0
        limit = self.limit or 0
        state = admission_state(agents, trainer, limit=limit, samples_per_group=per_group)
        OUTSTANDING.set(state.outstanding)
        return state

    async def _admit(self, task: TaskSubmitted, delivery: Delivery) -> None:
        """Wait for room (the ingress keeps the message in progress meanwhile), then admit
        ``task``. The admitted copy is de-duplicated by its id, so a redelivery after a crash
        admits it once."""
        WAITING.set(1)
        try:
            while (await self.state()).room <= 0:
                if self._stop.is_set():
                    raise HandBack("scheduler stopping")
                await asyncio.sleep(self._poll_s)
        finally:
            WAITING.set(0)
        await self._js.publish(
            self._names.tasks_admitted,
            codec.encode(task),
            headers=codec.headers(msg_id=f"admitted-{task.task_id}"),
        )
        self._group_sizes.append(task.group_size)
        ADMITTED.inc()
        ADMISSION_WAIT.observe(max(0.0, time.time() - delivery.published_at))
        log.debug(kv("task_admitted", task=task.task_id, group_size=task.group_size))
