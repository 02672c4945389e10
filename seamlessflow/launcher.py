"""Long-running local commands (the embedded broker) and what they share: signal handling, the
broker URL of a local run, and the status tables."""

import asyncio
import contextlib
import datetime
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from prometheus_client import CollectorRegistry

from broker import codec
from broker.auth import IDENTITIES_ENV, Authority, run_identities
from broker.config import EmbeddedBrokerConfig
from broker.control import SchedulerState, TrainerGroup
from broker.exceptions import (
    BrokerStartError,
    InvalidMessageError,
    RetryStoppedError,
    StoppedWaitingError,
)
from broker.messages import Message, Role
from broker.metrics import SERVER_REGISTRY, StreamDepthCollector
from broker.permissions import Principal
from broker.provision import RunStatus
from broker.registry import Sighting, read_registry
from broker.retry import retry
from broker.roles import ROLE_LEASE_SHARE
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from broker.worker_messages import WorkerRegistered
from common.log import kv
from common.metrics import MetricsEndpoint, metric_sum, scrape, serve_metrics
from common.ready import announce_ready
from tagsched.lease import lease_holder

log = logging.getLogger(__name__)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, so every loop can stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_signalled(serve, *args) -> None:
    """``await serve(*args, stop)`` with ``stop`` set by SIGINT/SIGTERM. Stopped while it still
    waited for the broker at start is a clean stop: nothing ran."""
    stop = stop_on_signals()
    try:
        await serve(*args, stop)
    except StoppedWaitingError as exc:
        print(exc, flush=True)


@dataclass(frozen=True)
class Broker:
    """The broker a local run uses: its client URL, its ``/metrics`` when embedded, the run's
    identity files when it issued them (embedded and not ``insecure``) or found them
    (``$SEAMLESSFLOW_NATS_IDENTITIES``), and the CA it is verified with when it speaks TLS.
    Nothing is put in this process's environment: each connection is given its files."""

    url: str
    metrics_url: str | None
    identities: dict[Principal, Path] | None = None
    ca: Path | None = None

    @property
    def admin(self) -> Path | None:
        """The identity the launcher connects as (None: ``$SEAMLESSFLOW_NATS_IDENTITY``)."""
        return self.identities[Principal.ADMIN] if self.identities else None


@asynccontextmanager
async def local_broker(
    explicit: str | None, config: EmbeddedBrokerConfig, run: str
) -> AsyncIterator[Broker]:
    """The broker at ``explicit`` when given (the user's, with its own metrics; with
    ``$SEAMLESSFLOW_NATS_IDENTITIES`` the run's identities from that folder, else everyone
    connects as ``$SEAMLESSFLOW_NATS_IDENTITY``); otherwise an embedded broker serving
    ``/metrics`` like ``seamlessflow broker``, for the duration, with ``run``'s identities
    issued."""
    if explicit:
        folder = os.environ.get(IDENTITIES_ENV)
        yield Broker(explicit, None, run_identities(Path(folder)) if folder else None)
        return
    embedded = EmbeddedBroker(config)
    identities = embedded.authority.issue_run(run) if embedded.authority else None
    ca = embedded.tls.ca if embedded.tls else None
    # Started from this (main) thread: the server is tied to it and dies with it.
    with embedded:
        if run in embedded.refused:
            raise BrokerStartError(
                f"the embedded broker cannot serve run {run!r}: {embedded.refused[run]}. Free "
                "disk (JetStream takes its storage from the state directory's disk) or lower "
                "[broker.account] max_file and max_memory"
            )
        async with broker_metrics(embedded.monitoring_url, config.metrics_port) as metrics:
            yield Broker(embedded.url, metrics.url, identities, ca)


@asynccontextmanager
async def broker_metrics(monitoring_url: str, port: int) -> AsyncIterator[MetricsEndpoint]:
    """``/metrics`` on ``port`` (0: a free one) with the depth of every stream and consumer of
    the broker monitored at ``monitoring_url``, polled in the background while the context is
    open, and the broker's own (``broker.metrics``: runs it refuses)."""
    collector = StreamDepthCollector()
    depths = CollectorRegistry()
    depths.register(collector)
    metrics = serve_metrics(depths, SERVER_REGISTRY, port=port)
    done = asyncio.Event()
    poll = asyncio.create_task(collector.poll(monitoring_url, done))
    try:
        yield metrics
    finally:
        done.set()
        await poll
        metrics.close()


async def serve_broker(config: EmbeddedBrokerConfig) -> None:
    """Run the embedded broker until SIGINT/SIGTERM, reporting stream depths on /metrics
    (``config.metrics_port``). With authorization on, it applies the identities that
    ``seamlessflow creds`` issues into its folder within a second (a configuration reload)."""
    stop = stop_on_signals()
    with EmbeddedBroker(config) as broker:
        async with broker_metrics(broker.monitoring_url, config.metrics_port) as metrics:
            authority = broker.authority
            announce_ready(
                "broker",
                metrics.url,
                nats=broker.url,
                monitoring=broker.monitoring_url,
                store=broker.store_dir,
                identities=authority.folder if authority else "none",
            )
            if authority is None:
                await stop.wait()
            else:
                await _reload_on_new_identities(broker, authority, stop)
    print("broker stopped", flush=True)


async def _reload_on_new_identities(
    broker: EmbeddedBroker, authority: Authority, stop: asyncio.Event, interval: float = 1.0
) -> None:
    """Reload when an identity is issued, replaced or removed, or when one expires."""
    known, expiry = authority.fingerprint(), authority.next_expiry()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        now = authority.fingerprint()
        expired = expiry is not None and expiry <= datetime.datetime.now(datetime.UTC)
        if now != known or expired:
            if expired:
                log.info(kv("broker_identities_expired", at=expiry.isoformat()))
            await asyncio.to_thread(broker.reload)
            known, expiry = now, authority.next_expiry()


def print_status(status: RunStatus, out=sys.stdout) -> None:
    rows = [("stream / consumer", "messages", "bytes", "pending", "ack pending")]
    for s in status.streams:
        rows.append((s.name, str(s.messages), str(s.bytes), "", ""))
        for c in s.consumers:
            rows.append((f"  {c.name}", "", "", str(c.pending), str(c.ack_pending)))
    _print_table(rows, out)
    for name in status.missing:
        print(f"missing: {name} (run `seamlessflow provision`)", file=out)


RoleSeconds = dict[tuple[str, str], float]
"""A worker's ``sf_worker_role_seconds`` by ``(role, state)``, read from its ``/metrics``."""


async def scrape_role_seconds(workers: list[Sighting]) -> dict[str, RoleSeconds | None]:
    """Each worker's seconds per role, busy and idle, from its ``/metrics`` (the registry does not
    carry them), all read at once; ``None`` for one whose endpoint did not answer (another
    network, gone) or answered as another process (a ``127.0.0.1`` URL read from another
    host: its ``sf_worker_info`` names another worker): the table says so, and the rest still
    shows."""

    async def read(worker_id: str, url: str) -> RoleSeconds | None:
        try:
            samples = await scrape(url)
        except (httpx.HTTPError, ValueError):
            return None
        if not metric_sum(samples, "sf_worker_info", worker_id=worker_id):
            return None
        name = "sf_worker_role_seconds_total"
        return {
            (r.value, state): metric_sum(samples, name, role=r.value, state=state)
            for r in Role
            for state in ("busy", "idle")
        }

    urls = {s.worker_id: s.entry.metrics_url for s in workers if s.entry and s.entry.metrics_url}
    seconds = await asyncio.gather(*(read(wid, url) for wid, url in urls.items()))
    return dict(zip(urls, seconds, strict=True))


@dataclass(frozen=True)
class ControlState:
    """What the run's state bucket (``sf-<run>-state``) says of the workers: the leading
    scheduler's fences and the trainer group (``None``: absent, or unreadable)."""

    scheduler: SchedulerState | None = None
    group: TrainerGroup | None = None

    def fenced(self, entry: WorkerRegistered) -> bool:
        """Whether the scheduler fenced this registration of the worker."""
        fence = self.scheduler.fence(entry.worker_id) if self.scheduler else None
        return fence is not None and fence.started_at == entry.started_at

    def rank(self, worker_id: str) -> int | None:
        """The worker's rank in the trainer group, if it is a member."""
        members = self.group.members if self.group else []
        return members.index(worker_id) if worker_id in members else None


async def read_control(js: JetStreamContext, names: RunNames) -> ControlState:
    """The scheduler's state and the trainer group record, as far as they exist and decode."""
    bucket = await js.key_value(names.state_kv)

    async def read(key: str, kind: type[Message]) -> Any:
        try:
            return codec.decode(kind, (await bucket.get(key)).value)
        except (KeyNotFoundError, InvalidMessageError):
            return None

    return ControlState(
        scheduler=await read(RunNames.SCHEDULER_STATE_KEY, SchedulerState),
        group=await read(RunNames.TRAINER_GROUP_KEY, TrainerGroup),
    )


@dataclass(frozen=True)
class WorkerRow:
    """What ``seamlessflow status`` knows of one worker: its registry entry as the server dated
    it, when the table was made (``now``, ``time.monotonic()``), the registry's TTL, and its
    seconds per role if they were asked for (``asked``; ``role_seconds`` ``None``: its
    ``/metrics`` did not answer)."""

    sighting: Sighting
    entry: WorkerRegistered
    now: float
    ttl: float | None = None
    role_seconds: RoleSeconds | None = None
    asked: bool = False
    control: ControlState = ControlState()

    def written(self) -> str:
        """How long ago the entry was written, dated by the server's clock alone; past ``ttl``
        marked "not renewed", as every observer judges it dead."""
        if not self.sighting.dated:  # a server that does not tell its time
            return "?"
        age = self.sighting.age(self.now)
        if self.ttl is not None and age > self.ttl:
            return f"{age:.1f}s ago (not renewed within {self.ttl:g}s)"
        return f"{age:.1f}s ago"

    def lease(self) -> str:
        """How long the worker still holds its role without another registry write (its role
        lease, ``broker.roles``: a share of the TTL from its last write), or "expired"."""
        if self.entry.role is Role.IDLE:
            return "-"
        if not self.sighting.dated or self.ttl is None:
            return "?"
        left = self.ttl * ROLE_LEASE_SHARE - self.sighting.age(self.now)
        return f"{left:.0f}s" if left > 0 else "expired"

    def lent(self) -> str:
        """A trainer group member serving rollout: lent by the scheduler."""
        rank = self.control.rank(self.entry.worker_id)
        return _yes(rank is not None and self.entry.role is Role.ROLLOUT)

    def clock(self) -> str:
        """The worker's ``heartbeat_at`` against the server's timestamp of the write."""
        offset = self.sighting.clock_offset()
        return "-" if offset is None else "ok" if abs(offset) < 1.0 else f"{offset:+.1f}s"

    def seconds(self) -> str:
        """``role=busy/idle`` seconds for every role it has spent time in."""
        if not self.asked or self.entry.metrics_url is None:
            return "-"
        if self.role_seconds is None:
            return "?"
        got = self.role_seconds
        return (
            ",".join(
                f"{r.value}={got[r.value, 'busy']:.0f}/{got[r.value, 'idle']:.0f}"
                for r in Role
                if got[r.value, "busy"] + got[r.value, "idle"] >= 0.5
            )
            or "0"
        )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


WORKER_COLUMNS: tuple[tuple[str, Callable[[WorkerRow], str]], ...] = (
    # One line a column; "clock" stays last (scripts read it from the end of a row).
    ("worker", lambda r: r.entry.worker_id),
    ("node", lambda r: r.entry.host),
    ("tags", lambda r: ",".join(r.entry.tags)),
    ("role", lambda r: r.entry.role.value),
    ("epoch", lambda r: str(r.entry.epoch)),
    ("version", lambda r: "-" if r.entry.version is None else str(r.entry.version)),
    ("busy", lambda r: _yes(r.entry.busy)),
    ("weights", lambda r: r.entry.weights.value),
    ("wave", lambda r: "-" if r.entry.wave is None else str(r.entry.wave)),
    ("quarantined", lambda r: _yes(r.entry.quarantined)),
    ("lease", WorkerRow.lease),
    ("fenced", lambda r: _yes(r.control.fenced(r.entry))),
    ("lent", WorkerRow.lent),
    ("rank", lambda r: "-" if (k := r.control.rank(r.entry.worker_id)) is None else str(k)),
    ("busy/idle s", WorkerRow.seconds),
    ("written", WorkerRow.written),
    ("clock", WorkerRow.clock),
)
"""The registry table's columns: a header and how a row's cell is made."""


def print_workers(
    workers: list[Sighting],
    leader: str | None,
    out=sys.stdout,
    *,
    ttl: float | None = None,
    now: float | None = None,
    role_seconds: dict[str, RoleSeconds | None] | None = None,
    control: ControlState = ControlState(),
) -> None:
    """The registry as a table (``WORKER_COLUMNS``: node, tags, role, epoch, version, where it
    stands in the weight rhythm, how long its role lease has left, whether it is fenced or lent
    and its trainer group rank (from ``control``), its busy/idle seconds per role from
    ``role_seconds``, when the entry was last written and how far the worker's clock is off),
    and the scheduler holding
    the run's lease. "written" is dated by the server's clock alone (the write's stored
    timestamp against the server's time now), so a worker whose clock is off shows its true age;
    past ``ttl`` it is marked "not renewed", as every observer judges it dead. "clock" is the
    worker's ``heartbeat_at`` against the server's timestamp of the write: information only."""
    now = time.monotonic() if now is None else now
    rows = [tuple(header for header, _ in WORKER_COLUMNS)]
    for s in workers:
        if s.entry is None:
            continue
        seconds = None if role_seconds is None else role_seconds.get(s.worker_id)
        row = WorkerRow(s, s.entry, now, ttl, seconds, role_seconds is not None, control)
        rows.append(tuple(cell(row) for _, cell in WORKER_COLUMNS))
    print(file=out)
    _print_table(rows, out)
    print(f"scheduler: {leader or 'none holds the lease'}", file=out)


def _print_table(rows: list[tuple[str, ...]], out) -> None:
    """The first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells).rstrip(), file=out)


REGISTRY_WAIT_S = 60.0
"""How long a run's summary waits for a broker that cannot answer, to read the registry."""


async def workers_and_leader(
    js: JetStreamContext, names: RunNames, give_up_s: float = REGISTRY_WAIT_S
) -> tuple[list[Sighting], str | None]:
    """The registry's workers and the scheduler lease's holder, for a summary at the run's
    end, read again while the broker cannot answer (a restart, a cluster that just lost a
    server) for up to ``give_up_s``; after that the summary goes without them, and a WARNING
    says why."""
    try:
        workers = await retry(
            lambda: read_registry(js, names), what="summary_registry", give_up_s=give_up_s
        )
        leader = await retry(
            lambda: lease_holder(js, names), what="summary_lease", give_up_s=give_up_s
        )
    except RetryStoppedError as exc:
        log.warning(kv("summary_without_workers", error=exc))
        return [], None
    return workers, leader
