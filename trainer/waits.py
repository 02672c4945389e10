"""How the trainer waits: ``wait_first`` (the first of several waits, or a timeout), and
``OrderWait``, a step's bounded wait for admission order: the asynchronous side of the pure
``trainer.order``, with its metrics and log lines."""

import asyncio
import logging
import time
from collections.abc import Callable

from common.log import kv
from common.staleness import StalenessMode
from trainer.batcher import Batcher
from trainer.config import TrainerConfig
from trainer.metrics import ORDER_GIVEN_UP, ORDER_WAIT

log = logging.getLogger(__name__)


class OrderWait:
    """The trainer's wait for earlier admitted tasks before a step; ``wake`` is the trainer's
    event, set when a sample comes."""

    def __init__(self, config: TrainerConfig, wake: asyncio.Event) -> None:
        self._config = config
        self._wake = wake
        self._waited_for = 0  # the admission ticket a step last waited for (logged once)
        self._waiting = 0
        self.on_waiting: Callable[[int], None] = lambda n: None
        """Told how many earlier tasks the next step waits for, each time it changes (the
        trainer's registry entry: the scheduler lends a colocated trainer's worker for them)."""

    @property
    def _applies(self) -> bool:
        config = self._config
        return config.staleness_mode is StalenessMode.DROP and config.order_wait_s > 0

    def due(self, batcher: Batcher, version: int) -> list[int]:
        """The earlier admitted tasks a step at ``version`` must take (``AdmissionOrder.due``:
        asking starts no wait), in drop mode with waits on; else none."""
        if not self._applies:
            return []
        return batcher.order.due(version, self._config.max_staleness)

    async def wait(
        self, batcher: Batcher, version: int, stop: asyncio.Event, complete: int
    ) -> bool:
        """With ``complete`` groups for a step (a batch's worth), in drop mode: wait (once,
        until a sample comes or a wait runs out) for the earlier admitted tasks a step at
        ``version`` would put past the staleness bound (``trainer.order``). Returns whether it
        waited."""
        blocking = self._blocking(batcher, version, complete)
        if not blocking:
            return False
        deadline = batcher.order.deadline()
        assert deadline is not None
        if blocking[0] != self._waited_for:  # once per ticket, not per sample that wakes it
            self._waited_for = blocking[0]
            log.info(kv("order_waiting", version=version, ticket=blocking[0], n=len(blocking)))
        self._wake.clear()
        started = time.monotonic()
        await wait_first(self._wake.wait(), stop.wait(), timeout=max(0.0, deadline - started))
        ORDER_WAIT.inc(time.monotonic() - started)
        return True

    def refresh(self, batcher: Batcher, version: int, complete: int) -> None:
        """As a sample comes, and while the trainer is lent: the earlier tasks a step at
        ``version`` waits for (those waited for ``order_wait_s`` given up), told while a batch's
        worth is ``complete`` (the scheduler counts fewer groups as missing itself; with
        ``overlap`` the groups computed ahead count, or every sample of a later task would tell
        none and the scheduler reclaim a worker lent for them). A trainer worker lent for them
        is reclaimed once they have come or are given up."""
        self._blocking(batcher, version, complete)

    def _blocking(self, batcher: Batcher, version: int, complete: int) -> list[int]:
        """With a batch's worth ``complete``, in drop mode: ``AdmissionOrder.blocking`` (it
        gives up the tickets waited for too long); else none. Told either way."""
        if not self._applies or complete < self._config.groups_per_step:
            self._tell(0)
            return []
        order = batcher.order
        before = order.given_up
        blocking = order.blocking(version, self._config.max_staleness, time.monotonic())
        if gave_up := order.given_up - before:
            ORDER_GIVEN_UP.inc(gave_up)
            log.warning(kv("order_given_up", tickets=gave_up, after_s=self._config.order_wait_s))
        self._tell(len(blocking))
        return blocking

    def _tell(self, waiting: int) -> None:
        if waiting != self._waiting:
            self._waiting = waiting
            self.on_waiting(waiting)


async def wait_first(*waits, timeout: float | None = None) -> None:  # noqa: ASYNC109
    """Wait for the first of ``waits`` (coroutines) to finish, or ``timeout``; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
