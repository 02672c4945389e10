"""How long a new weight version takes to reach every rollout worker, read off the registry."""

import asyncio
import logging
import time

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from broker.messages import Role, WorkerRegistered
from broker.registry import LastSeen, Sighting, watch_registry
from broker.retry import BACKOFF
from broker.subjects import RunNames
from common.log import kv
from trainer.metrics import SERVING_SECONDS

log = logging.getLogger(__name__)


class ServingWatch:
    """Times each version from its optimizer step until every live rollout worker in the
    registry reports it (a worker counts as live until ``ttl`` after its entry was last
    written, on this process's clock: ``broker.registry.LastSeen``), into
    ``sf_trainer_weights_serving_seconds``."""

    def __init__(self, ttl: float, keep: int = 16) -> None:
        self._ttl = ttl
        self._keep = keep
        self._workers: dict[str, WorkerRegistered] = {}  # in the rollout role
        self._engines: dict[str, WorkerRegistered] = {}  # tagged rollout, in any role
        self._heard = LastSeen()
        self._pending: dict[int, float] = {}  # version -> time.monotonic() of its step

    def stepped(self, version: int, at: float) -> None:
        """``version`` was made at ``at`` (``time.monotonic()``)."""
        self._pending[version] = at
        while len(self._pending) > self._keep:
            del self._pending[min(self._pending)]
        self._settle()

    def seen(self, sighting: Sighting) -> None:
        self._heard.saw(sighting)
        worker_id, entry = sighting.worker_id, sighting.entry
        for held, keep in (
            (self._workers, entry is not None and entry.role is Role.ROLLOUT),
            (self._engines, entry is not None and "rollout" in entry.tags),
        ):
            held.pop(worker_id, None)
            if keep and entry is not None:
                held[worker_id] = entry
        self._settle()

    async def follow(self, js: JetStreamContext, names: RunNames) -> None:
        """Follow the registry; a watch the broker dropped (a restart) is started again, so
        this only ends when cancelled."""
        while True:
            try:
                async for sighting in watch_registry(js, names):
                    self.seen(sighting)
            except NatsError as exc:
                log.warning(kv("worker_watch_failed", error=exc))
            await asyncio.sleep(BACKOFF.max_s)

    def live(self) -> dict[str, WorkerRegistered]:
        """The rollout workers whose entry was written within the TTL, on this process's clock."""
        return self._fresh(self._workers)

    def engines(self) -> dict[str, WorkerRegistered]:
        """The workers tagged ``rollout`` (whatever their role now: any may load a version next)
        whose entry was written within the TTL."""
        return self._fresh(self._engines)

    def _fresh(self, workers: dict[str, WorkerRegistered]) -> dict[str, WorkerRegistered]:
        return {wid: w for wid, w in workers.items() if self._heard.fresh(wid, self._ttl)}

    def _settle(self) -> None:
        """Observe each pending version every live rollout worker now serves."""
        live = list(self.live().values())
        if not live:
            return
        serving = min(w.version if w.version is not None else -1 for w in live)
        for version in [v for v in self._pending if v <= serving]:
            SERVING_SECONDS.observe(time.monotonic() - self._pending.pop(version))
