"""Long-running local commands (the embedded broker, a rollout worker) and what they share:
signal handling and the broker URL of a local run."""

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from broker.client import session
from broker.config import EmbeddedBrokerConfig, ProvisionConfig
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.metrics import StreamDepthCollector
from broker.provision import RunStatus
from broker.roles import REGISTRY as ROLE_METRICS
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from common.metrics import MetricsEndpoint, serve_metrics
from rollout.engines import EngineConfig, start_engine
from rollout.engines.base import REGISTRY as ENGINE_METRICS
from rollout.worker import REGISTRY as WORKER_METRICS
from rollout.worker import RolloutWorker, WorkerConfig


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
            print(
                f"broker ready: nats={broker.url} monitoring={broker.monitoring_url} "
                f"store={broker.store_dir} metrics={metrics.url}",
                flush=True,
            )
            await stop.wait()
    print("broker stopped", flush=True)


async def serve_worker(
    url: str,
    run: str,
    provision: ProvisionConfig,
    engine_config: EngineConfig,
    worker: WorkerConfig,
    metrics_port: int = 0,
) -> None:
    """Run one rollout worker until SIGINT/SIGTERM: engine, /metrics, then the worker loop."""
    stop = stop_on_signals()
    metrics = serve_metrics(
        WORKER_METRICS, ENGINE_METRICS, INGRESS_METRICS, ROLE_METRICS, port=metrics_port
    )
    loaded = await start_engine(engine_config)
    try:
        async with session(url, f"seamlessflow-worker-{worker.worker_id}") as nc:
            rollout = RolloutWorker(
                nc,
                RunNames(run),
                loaded,
                worker,
                provision.gen,
                nats_url=url,
                metrics_url=metrics.url,
            )
            ready = (
                f"worker {worker.worker_id} ready: engine={engine_config.settings.kind} "
                f"model={engine_config.model} run={run} metrics={metrics.url}"
            )
            await rollout.run(stop, on_ready=lambda: print(ready, flush=True))
    finally:
        await loaded.close()
        metrics.close()
    print(f"worker {worker.worker_id} stopped", flush=True)


def print_status(status: RunStatus, out=sys.stdout) -> None:
    rows = [("stream / consumer", "messages", "bytes", "pending", "ack pending")]
    for s in status.streams:
        rows.append((s.name, str(s.messages), str(s.bytes), "", ""))
        for c in s.consumers:
            rows.append((f"  {c.name}", "", "", str(c.pending), str(c.ack_pending)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells).rstrip(), file=out)
    for name in status.missing:
        print(f"missing: {name} (run `seamlessflow provision`)", file=out)
