"""The run's worker registry (the ``sf-<run>-workers`` KV bucket): a worker's own entry, kept
alive by heartbeats, and a watch over everyone's entries. Rollout workers and trainer ranks
register the same way.

Liveness never compares two machines' clocks. An entry's ``heartbeat_at`` is the writer's clock
and is information only (``seamlessflow status`` shows how far it is off). An observer judges an
entry by when it was last *written*, on the observer's own ``time.monotonic()``: an entry the
watch delivers as it changes was written when it arrived (every heartbeat rewrites the entry, so
every heartbeat arrives); an entry that was already there when the watch (or a one-off read)
started is dated by the server alone, its stored timestamp against the server's own time now
(``$JS.API.STREAM.INFO``'s ``ts``), both of one clock. ``Sighting`` carries that moment and
``LastSeen`` keeps it per worker: a worker is live while ``LastSeen.fresh(worker, ttl)``.
"""

import asyncio
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from broker import codec
from broker.exceptions import InvalidMessageError, ProvisionConflictError
from broker.messages import Role
from broker.node_tags import query_gpus, with_node_tags
from broker.subjects import RunNames
from broker.worker_messages import TrainerShape, WorkerRegistered
from common.log import kv

log = logging.getLogger(__name__)

CURRENT_STALL_S = 5.0
"""A watch whose current entries stop coming this long before they are complete is given up
(a broker error: watchers start again, a read tries once more). nats-py lost them once in a
while on a 2.9 server (a read of a registry rewritten every 50 ms waited forever)."""
READ_TRIES = 2
"""Watches a one-off read opens before a stall of its current entries is its error."""


def node_name() -> str:
    """The node this process runs on: ``$NODE_NAME`` where the deployment sets it (Kubernetes'
    downward API ``spec.nodeName``, as ``deploy/k8s`` does: a pod's own host name is the pod's),
    else the host name (a Slurm node's, a cluster node's)."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def default_worker_id(prefix: str = "", *, pid: bool = True) -> str:
    """``<prefix><host>-<pid>`` (``pid=False``: ``<prefix><host>``, the same after a restart), a
    valid id whatever the host name (``a.local`` -> ``a-local``)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
    return (f"{prefix}{host}-{os.getpid()}" if pid else f"{prefix}{host}")[-64:]


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
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``wall_clock``: what ``heartbeat_at`` and ``started_at`` are read from (a test's fault
        injector skews it; nobody's liveness depends on it)."""
        self._bucket = bucket
        self._wall_clock = wall_clock
        self.written_at = -math.inf
        """``time.monotonic()`` when the last write that succeeded was sent (so at or before the
        moment it was stored): what a worker's role lease runs from (``broker.roles``)."""
        self._next_write = asyncio.Event()  # set (and replaced) by each write that succeeds
        self._soon: set[asyncio.Task] = set()  # writes of ``put_soon`` in flight
        now = wall_clock()
        self._entry = WorkerRegistered(
            worker_id=worker_id,
            host=node_name(),
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
        cls, js: JetStreamContext, names: RunNames, worker_id: str, *, tags: list[str], **fields
    ) -> "Registration":
        """The entry of ``worker_id`` with ``tags`` and its node's (``broker.node_tags``)."""
        gpus = await asyncio.to_thread(query_gpus)
        tags = with_node_tags(tags, node_name(), gpus)
        return cls(await js.key_value(names.workers_kv), worker_id, tags=tags, **fields)

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
        self._entry = self._entry.model_copy(update={**update, "heartbeat_at": self._wall_clock()})
        sent = time.monotonic()
        await self._bucket.put(self.worker_id, codec.encode(self._entry))
        self.written_at = max(self.written_at, sent)
        self._next_write.set()
        self._next_write = asyncio.Event()

    def put_soon(self, **changes) -> None:
        """``put`` in a task, for a caller that cannot wait (a callback). A write the broker
        cannot take now is logged; the entry keeps the change and the next heartbeat carries it."""
        task = asyncio.get_running_loop().create_task(self._put_or_log(changes))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)

    async def _put_or_log(self, changes: dict) -> None:
        try:
            await self.put(**changes)
        except NatsError as exc:
            log.warning(kv("registry_write_failed", worker=self.worker_id, error=exc, **changes))

    async def next_write(self) -> None:
        """Return once a write succeeds (the first after this call)."""
        await self._next_write.wait()

    def now(self) -> float:
        """This worker's clock: the one ``heartbeat_at`` is read from, so the one a role
        change's ``expires_at`` is stated in."""
        return self._wall_clock()

    async def ttl(self) -> float:
        """The registry's TTL (``workers_ttl_s``, as the bucket was provisioned)."""
        status = await self._bucket.status()
        if not status.ttl:
            raise ProvisionConflictError(
                f"the worker registry {status.bucket} has no TTL: provision the run again"
            )
        return status.ttl

    def note(self, **changes) -> None:
        """Change the entry without writing it: the next ``put`` or heartbeat carries it."""
        self._entry = self._entry.model_copy(update=changes)

    def renew(self) -> None:
        """Begin a new registration (a fenced worker is re-admitted once it shows one)."""
        self._entry = self._entry.model_copy(update={"started_at": self._wall_clock()})

    async def keep_alive(
        self, period: float, then: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Write the entry every ``period`` seconds; after each write that succeeded, ``then()``
        (its broker errors are logged like the write's)."""
        while True:
            await asyncio.sleep(period)
            try:
                await self.put()
                if then is not None:
                    await then()
            except NatsError as exc:
                log.warning(kv("heartbeat_failed", worker=self.worker_id, error=exc))
            # nats-py waits for replies with asyncio.wait_for, which (Python 3.11) returns the
            # reply when a cancel lands as it arrives: the cancel is swallowed, and this loop
            # would outlive it (a worker that never stopped, with heartbeats every 0.5 s).
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise asyncio.CancelledError

    async def delete(self) -> None:
        """Remove the entry. Called on the way out, so a broker outage is logged, not raised: it
        would hide why the process stops, and the entry expires after the bucket's TTL anyway."""
        try:
            await self._bucket.delete(self.worker_id)
        except NatsError as exc:
            log.warning(kv("registration_delete_failed", worker=self.worker_id, error=exc))


@dataclass(frozen=True)
class Sighting:
    """A worker's entry as an observer saw it: ``entry`` (``None``: deleted), ``written_at`` (the
    observer's ``time.monotonic()`` at which the entry was written, as near as it can tell) and
    ``stored_at`` (the server's timestamp of the write, seconds since the epoch on the server's
    clock; ``None`` when unknown). ``dated``: ``written_at`` was worked out from the server's
    clock (an entry that was there already); otherwise it is the arrival (a change as it
    happens, or any entry from a server that does not tell its time)."""

    worker_id: str
    entry: WorkerRegistered | None
    written_at: float
    stored_at: float | None = None
    dated: bool = False

    def age(self, now: float | None = None) -> float:
        """Seconds since the write, on the observer's clock (``now``: its ``time.monotonic()``)."""
        return max(0.0, (time.monotonic() if now is None else now) - self.written_at)

    def clock_offset(self) -> float | None:
        """How far the writer's clock is ahead of the server's (``heartbeat_at`` against the
        stored timestamp, the delivery time included): information, never liveness."""
        if self.entry is None or self.stored_at is None:
            return None
        return self.entry.heartbeat_at - self.stored_at


class LastSeen:
    """When each worker's entry was last written, on this process's clock only (``clock``,
    ``time.monotonic`` unless a test gives another): a worker is ``fresh`` while that is no older
    than the TTL. Fed with every ``Sighting`` of a watch; pure, no I/O."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._written: dict[str, float] = {}

    def saw(self, sighting: Sighting) -> None:
        if sighting.entry is None:
            self._written.pop(sighting.worker_id, None)
        else:
            self._written[sighting.worker_id] = sighting.written_at

    def age(self, worker_id: str) -> float | None:
        """Seconds since ``worker_id``'s entry was last written; ``None`` if never seen."""
        written = self._written.get(worker_id)
        return None if written is None else max(0.0, self._clock() - written)

    def fresh(self, worker_id: str, within: float) -> bool:
        age = self.age(worker_id)
        return age is not None and age <= within


async def server_time(js: JetStreamContext, stream: str) -> tuple[float, float] | None:
    """``(server_now, at)``: the server's own time (seconds since the epoch, its clock) as it
    answered ``$JS.API.STREAM.INFO`` for ``stream``, and this process's ``time.monotonic()`` at
    that moment (the middle of the round trip). ``None`` from a server that does not say (its
    info has no ``ts``: before nats-server 2.10)."""
    prefix = getattr(js, "_prefix", "$JS.API")
    sent = time.monotonic()
    reply = await js._nc.request(f"{prefix}.STREAM.INFO.{stream}", b"", timeout=5)
    at = (sent + time.monotonic()) / 2
    try:
        stamp = json.loads(reply.data).get("ts")
    except ValueError:
        return None
    server_now = parse_rfc3339(stamp) if isinstance(stamp, str) else None
    return None if server_now is None else (server_now, at)


async def _server_clock(
    js: JetStreamContext, names: RunNames, watcher: KeyValue.KeyWatcher, opened: float
) -> tuple[float, float] | None:
    """``server_time`` of the registry's stream; from a server before 2.10 (no ``ts``), the
    creation time of ``watcher``'s consumer, which the server made when the watch was opened
    (``opened``: this process's ``time.monotonic()`` then)."""
    clock = await server_time(js, f"KV_{names.workers_kv}")
    if clock is None:
        info = await watcher._sub.consumer_info()
        if isinstance(info.created, datetime):
            clock = (info.created.timestamp(), opened)
    return clock


def parse_rfc3339(stamp: str) -> float | None:
    """Seconds since the epoch of a Go RFC 3339 timestamp (nanoseconds allowed); ``None`` for
    Go's zero time or a string that is no timestamp."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        seconds = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    digits = "".join(c for c in frac if c.isdigit())
    if seconds <= 0:
        return None
    return seconds + (int(digits) / 10 ** len(digits) if digits else 0.0)


async def watch_registry(
    js: JetStreamContext, names: RunNames, on_current: Callable[[], None] = lambda: None
) -> AsyncIterator[Sighting]:
    """Every change of the registry as a ``Sighting``, current entries first (then
    ``on_current`` is called); its ``entry`` is ``None`` when the worker's entry was deleted.
    A change is dated by its arrival; a current entry by the server (its stored timestamp
    against the server's time now: no other clock is compared; a server before 2.10 tells its
    time through the watch's consumer, created when the watch opened). An entry that expires
    is not announced (a watch is not told): ``LastSeen`` finds it stale. Bad entries are logged
    and skipped."""
    bucket = await js.key_value(names.workers_kv)
    opened = time.monotonic()
    watcher = await bucket.watchall()
    opened = (opened + time.monotonic()) / 2
    try:
        async for item in _current_then_changes(watcher):
            if isinstance(item, list):  # the current entries: date them by the server
                clock = await _server_clock(js, names, watcher, opened) if item else None
                for found, arrived in item:
                    if (sighting := _sighting(found, arrived, clock)) is not None:
                        yield sighting
                on_current()
            elif (sighting := _sighting(*item, None)) is not None:
                yield sighting
    finally:
        await watcher.stop()


async def _current_then_changes(
    watcher: KeyValue.KeyWatcher,
) -> AsyncIterator[list[tuple[KeyValue.Entry, float]] | tuple[KeyValue.Entry, float]]:
    """The entries current when ``watcher`` opened, once, as a list; then each change; each
    with its arrival (``time.monotonic()``). nats-py's end-of-current marker (``None``) can come
    before entries its consumer delivered already (they were on their way when it asked the
    server how many were pending): the current entries end once as many have arrived as the
    consumer had delivered when the marker came. Raises ``NatsTimeoutError`` when they stall
    for ``CURRENT_STALL_S``."""
    current: list[tuple[KeyValue.Entry, float]] = []
    owed: int | None = None
    while owed is None or len(current) < owed:
        try:
            entry = await watcher.updates(CURRENT_STALL_S)
        except NatsTimeoutError:
            log.warning(kv("registry_current_stalled", received=len(current), owed=owed))
            raise
        if entry is KeyValue.KeyWatcher.STOP_ITER:  # stopped
            return
        if entry is not None:
            current.append((entry, time.monotonic()))
        elif owed is None:
            delivered = (await watcher._sub.consumer_info()).delivered
            owed = delivered.consumer_seq if delivered is not None else 0
    yield current
    async for entry in watcher:
        if entry is not None:
            yield entry, time.monotonic()


def _sighting(
    found: KeyValue.Entry, arrived: float, clock: tuple[float, float] | None
) -> Sighting | None:
    stored = found.created.timestamp() if isinstance(found.created, datetime) else None
    written, dated = arrived, False
    if clock is not None and stored is not None:
        server_now, at = clock
        written, dated = min(arrived, at - max(0.0, server_now - stored)), True
    if found.operation in ("DEL", "PURGE") or not found.value:
        return Sighting(found.key, None, written, stored, dated)
    try:
        entry = codec.decode(WorkerRegistered, found.value)
    except InvalidMessageError as exc:
        log.warning(kv("bad_worker_entry", key=found.key, error=exc.reason))
        return None
    return Sighting(found.key, entry, written, stored, dated)


async def watch_workers(
    js: JetStreamContext, names: RunNames, on_current: Callable[[], None] = lambda: None
) -> AsyncIterator[tuple[str, WorkerRegistered | None]]:
    """``watch_registry`` as ``(worker_id, entry)``, for who needs no liveness (scrape
    targets)."""
    async for sighting in watch_registry(js, names, on_current):
        yield sighting.worker_id, sighting.entry


async def read_registry(js: JetStreamContext, names: RunNames) -> list[Sighting]:
    """The registry's entries now, by worker id, each dated by the server like
    ``watch_registry``'s current entries (for one-off readers: ``seamlessflow status``, a weight
    wave). One that expired may linger until the bucket drops it: its age says so."""
    for tries in range(1, READ_TRIES + 1):
        try:
            current, clock = await _read_current(js, names)
            break
        except NatsTimeoutError:
            if tries == READ_TRIES:
                raise
    found: dict[str, Sighting] = {}
    for entry, arrived in current:  # in order: a key's later write (or delete) wins
        if (sighting := _sighting(entry, arrived, clock)) is not None:
            found[sighting.worker_id] = sighting
    return [found[k] for k in sorted(found) if found[k].entry is not None]


async def _read_current(
    js: JetStreamContext, names: RunNames
) -> tuple[list[tuple[KeyValue.Entry, float]], tuple[float, float] | None]:
    """One watch's current entries, and the server's clock to date them."""
    bucket = await js.key_value(names.workers_kv)
    opened = time.monotonic()
    watcher = await bucket.watchall()
    opened = (opened + time.monotonic()) / 2
    try:
        first = _current_then_changes(watcher)
        current = await anext(first)  # the current entries come first, as a list
        await first.aclose()
        assert isinstance(current, list)
        clock = await _server_clock(js, names, watcher, opened) if current else None
    finally:
        await watcher.stop()
    return current, clock
