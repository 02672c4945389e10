"""How long a new weight version takes to reach every rollout worker, read off the registry."""

import asyncio
import logging
import time
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from broker.messages import Role
from broker.registry import LastSeen, Sighting, watch_registry
from broker.retry import BACKOFF
from broker.subjects import RunNames
from broker.worker_messages import WorkerRegistered, has_tags
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
        self._entries: dict[str, WorkerRegistered] = {}  # every worker in the registry
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
        if sighting.entry is None:
            self._entries.pop(sighting.worker_id, None)
        else:
            self._entries[sighting.worker_id] = sighting.entry
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
        return self._fresh(lambda w: w.role is Role.ROLLOUT)

    def engines(self) -> dict[str, WorkerRegistered]:
        """The workers that may load a version next, whose entry was written within the TTL:
        those in the rollout role and those tagged ``rollout`` in any role (a colocated worker
        lent to training)."""
        return self._fresh(lambda w: w.role is Role.ROLLOUT or has_tags(w.tags, ["rollout"]))

    def _fresh(self, keep: Callable[[WorkerRegistered], bool]) -> dict[str, WorkerRegistered]:
        return {
            wid: w
            for wid, w in self._entries.items()
            if keep(w) and self._heard.fresh(wid, self._ttl)
        }

    def _settle(self) -> None:
        """Observe each pending version every live rollout worker now serves."""
        live = list(self.live().values())
        if not live:
            return
        serving = min(w.version if w.version is not None else -1 for w in live)
        for version in [v for v in self._pending if v <= serving]:
            SERVING_SECONDS.observe(time.monotonic() - self._pending.pop(version))
