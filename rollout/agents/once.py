"""Once per task id in a process: a task delivered again while it runs here (its in-progress
signals lost in an outage, or admitted again after one) waits for that run; one delivered again
after it was done here returns at once. Neither runs a second time.
"""

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

DONE_KEPT = 65536
"""Task ids a runner remembers as done, to ack a late redelivery without running it again."""


class OncePerTask:
    """The task ids running and (the last ``DONE_KEPT``) done here."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Event] = {}  # task id -> set when that run ends
        self._done: OrderedDict[str, None] = OrderedDict()

    async def run(
        self,
        task_id: str,
        work: Callable[[], Awaitable[None]],
        duplicate: Callable[[str], None],
    ) -> None:
        """``work()``, unless ``task_id`` runs or ran here: then ``duplicate("running")`` and
        wait for that run, or ``duplicate("done")`` and return."""
        while (running := self._running.get(task_id)) is not None:
            duplicate("running")
            await running.wait()
        if task_id in self._done:
            duplicate("done")
            return
        ended = self._running[task_id] = asyncio.Event()
        try:
            await work()
        finally:
            del self._running[task_id]
            ended.set()
        self._done[task_id] = None
        if len(self._done) > DONE_KEPT:
            self._done.popitem(last=False)
