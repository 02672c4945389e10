"""The run's worker registry (the ``sf-<run>-workers`` KV bucket): a worker's own entry, kept
alive by heartbeats, and a watch over everyone's entries. Rollout workers and trainer ranks
register the same way."""

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from broker import codec
from broker.exceptions import InvalidMessageError
from broker.messages import Role, WorkerRegistered
from broker.subjects import RunNames
from common.log import kv

log = logging.getLogger(__name__)


def default_worker_id(prefix: str = "") -> str:
    """``<prefix><host>-<pid>``, a valid id whatever the host name (``a.local`` -> ``a-local``)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
    return f"{prefix}{host}-{os.getpid()}"[-64:]


class Registration:
    """One worker's entry: ``put`` writes it now (with a fresh heartbeat), ``keep_alive`` renews
    it every ``period`` seconds until ``stop``, ``delete`` removes it."""

    def __init__(
        self,
        bucket: KeyValue,
        worker_id: str,
        *,
        tags: list[str],
        role: Role,
        version: int | None = None,
        metrics_url: str | None = None,
    ) -> None:
        self._bucket = bucket
        self._entry = WorkerRegistered(
            worker_id=worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            tags=tags,
            role=role,
            version=version,
            metrics_url=metrics_url,
            heartbeat_at=time.time(),
        )

    @classmethod
    async def open(
        cls, js: JetStreamContext, names: RunNames, worker_id: str, **fields
    ) -> "Registration":
        return cls(await js.key_value(names.workers_kv), worker_id, **fields)

    @property
    def worker_id(self) -> str:
        return self._entry.worker_id

    async def put(self, *, version: int | None = None) -> None:
        """Write the entry, with ``version`` as the loaded weight version when given."""
        update: dict = {"heartbeat_at": time.time()}
        if version is not None:
            update["version"] = version
        self._entry = self._entry.model_copy(update=update)
        await self._bucket.put(self.worker_id, codec.encode(self._entry))

    async def keep_alive(self, period: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(period)
            try:
                await self.put()
            except NatsError as exc:
                log.warning(kv("heartbeat_failed", worker=self.worker_id, error=exc))

    async def delete(self) -> None:
        """Remove the entry. Called on the way out, so a broker outage is logged, not raised: it
        would hide why the process stops, and the entry expires after the bucket's TTL anyway."""
        try:
            await self._bucket.delete(self.worker_id)
        except NatsError as exc:
            log.warning(kv("registration_delete_failed", worker=self.worker_id, error=exc))


async def watch_workers(
    js: JetStreamContext, names: RunNames
) -> AsyncIterator[tuple[str, WorkerRegistered | None]]:
    """Every change of the registry as ``(worker_id, entry)``, current entries first; ``None``
    when a worker's entry was deleted or expired. Bad entries are logged and skipped."""
    bucket = await js.key_value(names.workers_kv)
    watcher = await bucket.watchall()
    try:
        async for entry in watcher:
            if entry is None:  # the end of the initial values
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                yield entry.key, None
                continue
            try:
                yield entry.key, codec.decode(WorkerRegistered, entry.value)
            except InvalidMessageError as exc:
                log.warning(kv("bad_worker_entry", key=entry.key, error=exc.reason))
    finally:
        await watcher.stop()
