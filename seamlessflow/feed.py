"""The built-in task feed of ``seamlessflow run`` (``[tasks]``): tasks of the configured env,
submitted as any client would submit them."""

import random

from nats.aio.client import Client

from broker.exceptions import BrokerError
from broker.messages import TaskSubmitted
from broker.retry import TRANSIENT
from broker.subjects import Durable, RunNames
from rollout.agents import arithmetic, calculator, guess
from seamlessflow.config import RunConfig
from seamlessflow.submit import submit_tasks


class TaskFeed:
    """Feeds the built-in tasks (none for env 'none'), one group per task, as any client would:
    it keeps ``tasks.backlog`` tasks waiting for the scheduler, whose admission control paces
    them (``tagsched.admission``)."""

    def __init__(self, nc: Client, names: RunNames, config: RunConfig) -> None:
        self._js = nc.jetstream()
        self._names = names
        self._config = config.tasks
        self._rng = random.Random(config.tasks.seed)
        self._submitted: int | None = None  # read from the stream at the first top-up

    async def top_up(self) -> None:
        if self._config.env == "none":
            return
        if self._submitted is None:
            # Number on from every task the run's stream was ever given: a restarted run's ids
            # are new, not its first run's (which JetStream would drop as duplicates, or which
            # would name two tasks alike in the trajectories).
            stream = await self._js.stream_info(self._names.tasks_stream)
            self._submitted = stream.state.last_seq
        waiting = await self._js.consumer_info(self._names.tasks_stream, Durable.SCHEDULER)
        missing = self._config.backlog - waiting.num_pending
        if missing <= 0:
            return
        tasks = self._tasks(missing, prefix=f"t{self._submitted}")  # see task_number
        self._submitted += missing
        try:
            await submit_tasks(self._js, self._names, tasks, progress=False)
        except BrokerError as exc:
            if isinstance(exc.__cause__, TRANSIENT):  # e.g. a cluster electing a new leader
                raise exc.__cause__ from exc
            raise

    def _tasks(self, n: int, prefix: str) -> list[TaskSubmitted]:
        c = self._config
        shared = dict(group_size=c.group_size, max_turns=c.max_turns, max_tokens=c.max_tokens)
        if c.env == "calculator":
            return calculator.calculator_tasks(self._rng, n, tools=c.tools, prefix=prefix, **shared)
        if c.env == "guess":
            return guess.guess_tasks(
                self._rng,
                n,
                high=c.max_number,
                turn_delay_s=c.turn_delay_s,
                prefix=prefix,
                **shared,
            )
        return arithmetic.arithmetic_tasks(
            self._rng, n, max_operand=c.max_operand, prefix=prefix, **shared
        )


def task_number(task_id: str) -> int:
    """Which of the run's tasks ``task_id`` is (0, 1, ... in submission order, counting every
    task its stream was given): the feed names them ``t<first>-<i>``, the ``i``-th of a batch
    whose first is the stream's ``first``-th task."""
    first, i = task_id.removeprefix("t").split("-")
    return int(first) + int(i)
