"""How the trainer waits: ``wait_first`` (the first of several waits, or a timeout), and
``OrderWait``, a step's bounded wait for admission order: the asynchronous side of the pure
``trainer.order``, with its metrics and log lines."""

import asyncio
import logging
import time

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
        config = self._config
        if not self._applies or complete < config.groups_per_step:
            return False
        order = batcher.order
        before = order.given_up
        blocking = order.blocking(version, config.max_staleness, time.monotonic())
        if gave_up := order.given_up - before:
            ORDER_GIVEN_UP.inc(gave_up)
            log.warning(kv("order_given_up", tickets=gave_up, after_s=config.order_wait_s))
        if not blocking:
            return False
        deadline = order.deadline()
        assert deadline is not None
        if blocking[0] != self._waited_for:  # once per ticket, not per sample that wakes it
            self._waited_for = blocking[0]
            log.info(kv("order_waiting", version=version, ticket=blocking[0], n=len(blocking)))
        self._wake.clear()
        started = time.monotonic()
        await wait_first(self._wake.wait(), stop.wait(), timeout=max(0.0, deadline - started))
        ORDER_WAIT.inc(time.monotonic() - started)
        return True


async def wait_first(*waits, timeout: float | None = None) -> None:  # noqa: ASYNC109
    """Wait for the first of ``waits`` (coroutines) to finish, or ``timeout``; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
