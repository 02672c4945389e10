"""Long-running local commands (the embedded broker) and what they share: signal handling, the
broker URL of a local run, and the status tables."""

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from broker.client import session
from broker.config import EmbeddedBrokerConfig
from broker.metrics import StreamDepthCollector
from broker.provision import RunStatus
from broker.registry import Sighting
from broker.server import EmbeddedBroker
from common.metrics import MetricsEndpoint, serve_metrics
from common.ready import announce_ready


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, so every loop can stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_signalled(serve, *args) -> None:
    """``await serve(*args, stop)`` with ``stop`` set by SIGINT/SIGTERM."""
    await serve(*args, stop_on_signals())


@dataclass(frozen=True)
class Broker:
    """The broker a local run uses: its client URL, and its ``/metrics`` when embedded."""

    url: str
    metrics_url: str | None


@asynccontextmanager
async def local_broker(explicit: str | None, config: EmbeddedBrokerConfig) -> AsyncIterator[Broker]:
    """The broker at ``explicit`` when given (the user's, with its own metrics); otherwise an
    embedded broker serving ``/metrics`` like ``seamlessflow broker``, for the duration."""
    if explicit:
        yield Broker(explicit, None)
        return
    # Started from this (main) thread: the server is tied to it and dies with it.
    with EmbeddedBroker(config) as embedded:
        async with broker_metrics(embedded.url, config.metrics_port) as metrics:
            yield Broker(embedded.url, metrics.url)


@asynccontextmanager
async def broker_metrics(url: str, port: int) -> AsyncIterator[MetricsEndpoint]:
    """``/metrics`` on ``port`` (0: a free one) with the depth of every stream and consumer of
    the broker at ``url``, polled in the background while the context is open."""
    collector = StreamDepthCollector()
    depths = CollectorRegistry()
    depths.register(collector)
    metrics = serve_metrics(depths, port=port)
    try:
        async with session(url, "seamlessflow-broker-metrics") as nc:
            done = asyncio.Event()
            poll = asyncio.create_task(collector.poll(nc.jetstream(), done))
            try:
                yield metrics
            finally:
                done.set()
                await poll
    finally:
        metrics.close()


async def serve_broker(config: EmbeddedBrokerConfig) -> None:
    """Run the embedded broker until SIGINT/SIGTERM, reporting stream depths on /metrics
    (``config.metrics_port``)."""
    stop = stop_on_signals()
    with EmbeddedBroker(config) as broker:
        async with broker_metrics(broker.url, config.metrics_port) as metrics:
            announce_ready(
                "broker",
                metrics.url,
                nats=broker.url,
                monitoring=broker.monitoring_url,
                store=broker.store_dir,
            )
            await stop.wait()
    print("broker stopped", flush=True)


def print_status(status: RunStatus, out=sys.stdout) -> None:
    rows = [("stream / consumer", "messages", "bytes", "pending", "ack pending")]
    for s in status.streams:
        rows.append((s.name, str(s.messages), str(s.bytes), "", ""))
        for c in s.consumers:
            rows.append((f"  {c.name}", "", "", str(c.pending), str(c.ack_pending)))
    _print_table(rows, out)
    for name in status.missing:
        print(f"missing: {name} (run `seamlessflow provision`)", file=out)


def print_workers(
    workers: list[Sighting],
    leader: str | None,
    out=sys.stdout,
    *,
    ttl: float | None = None,
    now: float | None = None,
) -> None:
    """The registry as a table (node, tags, role, epoch, version, when the entry was last
    written and how far the worker's clock is off), and the scheduler holding the run's lease.
    "written" is dated by the server's clock alone (the write's stored timestamp against the
    server's time now), so a worker whose clock is off shows its true age; past ``ttl`` it is
    marked "not renewed", as every observer judges it dead. "clock" is the worker's
    ``heartbeat_at`` against the server's timestamp of the write: information only."""
    now = time.monotonic() if now is None else now
    rows = [("worker", "node", "tags", "role", "epoch", "version", "busy", "written", "clock")]
    for s in workers:
        w = s.entry
        if w is None:
            continue
        version = "-" if w.version is None else str(w.version)
        if not s.dated:  # a server that does not tell its time
            written = "?"
        else:
            age = s.age(now)
            written = f"{age:.1f}s ago"
            if ttl is not None and age > ttl:
                written += f" (not renewed within {ttl:g}s)"
        offset = s.clock_offset()
        clock = "-" if offset is None else "ok" if abs(offset) < 1.0 else f"{offset:+.1f}s"
        row = (
            w.worker_id,
            w.host,
            ",".join(w.tags),
            w.role.value,
            str(w.epoch),
            version,
            "yes" if w.busy else "no",
            written,
            clock,
        )
        rows.append(row)
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
