"""The run's worker registry (the ``sf-<run>-workers`` KV bucket): a worker's own entry, kept
alive by heartbeats, and a watch over everyone's entries. Rollout workers and trainer ranks
register the same way."""

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Callable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from broker import codec
from broker.exceptions import InvalidMessageError
from broker.messages import Role, TrainerShape, WorkerRegistered
from broker.subjects import RunNames
from common.log import kv

log = logging.getLogger(__name__)


def default_worker_id(prefix: str = "") -> str:
    """``<prefix><host>-<pid>``, a valid id whatever the host name (``a.local`` -> ``a-local``)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
    return f"{prefix}{host}-{os.getpid()}"[-64:]


class Registration:
    """One worker's entry: ``put`` writes it now (with a fresh heartbeat), ``keep_alive`` renews
    it every ``period`` seconds until cancelled, ``delete`` removes it."""

    def __init__(
        self,
        bucket: KeyValue,
        worker_id: str,
        *,
        tags: list[str],
        role: Role,
        capacity: int = 1,
        version: int | None = None,
        metrics_url: str | None = None,
        trainer: TrainerShape | None = None,
    ) -> None:
        self._bucket = bucket
        now = time.time()
        self._entry = WorkerRegistered(
            worker_id=worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            tags=tags,
            role=role,
            capacity=capacity,
            version=version,
            metrics_url=metrics_url,
            trainer=trainer,
            started_at=now,
            heartbeat_at=now,
        )

    @classmethod
    async def open(
        cls, js: JetStreamContext, names: RunNames, worker_id: str, **fields
    ) -> "Registration":
        return cls(await js.key_value(names.workers_kv), worker_id, **fields)

    @property
    def worker_id(self) -> str:
        return self._entry.worker_id

    @property
    def entry(self) -> WorkerRegistered:
        return self._entry

    async def put(self, **changes) -> None:
        """Write the entry with a fresh heartbeat and ``changes`` (``version``, ``role``,
        ``epoch``, ``busy``); a change given as ``None`` keeps the field as it is."""
        update = {k: v for k, v in changes.items() if v is not None}
        self._entry = self._entry.model_copy(update={**update, "heartbeat_at": time.time()})
        await self._bucket.put(self.worker_id, codec.encode(self._entry))

    def note(self, **changes) -> None:
        """Change the entry without writing it: the next ``put`` or heartbeat carries it."""
        self._entry = self._entry.model_copy(update=changes)

    def renew(self) -> None:
        """Begin a new registration (a fenced worker is re-admitted once it shows one)."""
        self._entry = self._entry.model_copy(update={"started_at": time.time()})

    async def keep_alive(self, period: float) -> None:
        while True:
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
    js: JetStreamContext, names: RunNames, on_current: Callable[[], None] = lambda: None
) -> AsyncIterator[tuple[str, WorkerRegistered | None]]:
    """Every change of the registry as ``(worker_id, entry)``, current entries first (then
    ``on_current`` is called); ``None`` when a worker's entry was deleted. An entry that expires
    is not announced: its ``heartbeat_at`` says how fresh it is. Bad entries are logged and
    skipped."""
    bucket = await js.key_value(names.workers_kv)
    watcher = await bucket.watchall()
    try:
        async for entry in watcher:
            if entry is None:  # the end of the initial values
                on_current()
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


async def read_workers(js: JetStreamContext, names: RunNames) -> list[WorkerRegistered]:
    """The registry's entries now, by worker id (an expired one may linger until the bucket
    drops it: its ``heartbeat_at`` says how fresh it is). Bad entries are logged and skipped."""
    bucket = await js.key_value(names.workers_kv)
    try:
        keys = await bucket.keys()
    except NoKeysError:
        return []
    found = []
    for key in sorted(keys):
        try:
            entry = await bucket.get(key)
        except KeyNotFoundError:  # deleted since it was listed
            continue
        try:
            found.append(codec.decode(WorkerRegistered, entry.value))
        except InvalidMessageError as exc:
            log.warning(kv("bad_worker_entry", key=key, error=exc.reason))
    return found
