"""Long-running local commands (the embedded broker, a rollout worker) and what they share:
signal handling and the broker URL of a local run."""

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry

from broker.client import session
from broker.config import EmbeddedBrokerConfig, ProvisionConfig
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.metrics import StreamDepthCollector
from broker.provision import RunStatus
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from common.metrics import serve_metrics
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


@asynccontextmanager
async def nats_url(explicit: str | None, broker: EmbeddedBrokerConfig) -> AsyncIterator[str]:
    """``explicit`` when given; otherwise an embedded broker's URL for the duration."""
    if explicit:
        yield explicit
        return
    # Started from this (main) thread: the server is tied to it and dies with it.
    embedded = EmbeddedBroker(broker).start()
    try:
        yield embedded.url
    finally:
        embedded.stop()


async def serve_broker(config: EmbeddedBrokerConfig, metrics_port: int) -> None:
    """Run the embedded broker until SIGINT/SIGTERM, reporting stream depths on /metrics."""
    stop = stop_on_signals()
    with EmbeddedBroker(config) as broker:
        collector = StreamDepthCollector()
        depths = CollectorRegistry()
        depths.register(collector)
        metrics = serve_metrics(depths, port=metrics_port)
        try:
            async with session(broker.url, "seamlessflow-broker") as nc:
                print(
                    f"broker ready: nats={broker.url} monitoring={broker.monitoring_url} "
                    f"metrics={metrics.url} store={broker.store_dir}",
                    flush=True,
                )
                await collector.poll(nc.jetstream(), stop)
        finally:
            metrics.close()
    print("broker stopped", flush=True)


async def serve_worker(
    url: str,
    run: str,
    provision: ProvisionConfig,
    engine: str,
    engine_config: EngineConfig,
    worker: WorkerConfig,
    metrics_port: int = 0,
) -> None:
    """Run one rollout worker until SIGINT/SIGTERM: engine, /metrics, then the worker loop."""
    stop = stop_on_signals()
    metrics = serve_metrics(WORKER_METRICS, ENGINE_METRICS, INGRESS_METRICS, port=metrics_port)
    loaded = await start_engine(engine, engine_config)
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
                f"worker {worker.worker_id} ready: engine={engine} model={engine_config.model} "
                f"run={run} metrics={metrics.url}"
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
