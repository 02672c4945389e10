"""Long-running local commands (the embedded broker, a rollout worker) and what they share:
signal handling and the broker URL of a local run."""

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from broker.client import session
from broker.config import EmbeddedBrokerConfig, ProvisionConfig
from broker.messages import Role, WorkerRegistered
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.metrics import StreamDepthCollector
from broker.provision import RunStatus
from broker.registry import Registration
from broker.roles import REGISTRY as ROLE_METRICS
from broker.roles import RoleHolder
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from common.metrics import MetricsEndpoint, serve_metrics
from common.ready import announce_ready
from rollout.engines import EngineConfig, start_engine
from rollout.engines.base import REGISTRY as ENGINE_METRICS
from rollout.worker import REGISTRY as WORKER_METRICS
from rollout.worker import RolloutWorker, WorkerConfig

if TYPE_CHECKING:
    from trainer.config import TrainerConfig


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


async def serve_worker(
    url: str,
    run: str,
    provision: ProvisionConfig,
    engine_config: EngineConfig,
    worker: WorkerConfig,
    metrics_port: int = 0,
    trainer: "TrainerConfig | None" = None,
) -> None:
    """Run one worker process until SIGINT/SIGTERM: engine, /metrics, then the worker loop.
    With ``trainer`` (a worker tagged ``train``) the process also holds a trainer on the same
    model, and takes the ``train`` role as well as ``rollout`` and ``idle``."""
    stop = stop_on_signals()
    parts = [WORKER_METRICS, ENGINE_METRICS, INGRESS_METRICS, ROLE_METRICS]
    if trainer is not None:
        from trainer.service import REGISTRY as TRAINER_METRICS

        parts.append(TRAINER_METRICS)
    metrics = serve_metrics(*parts, port=metrics_port)
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
                f"model={engine_config.model} run={run} tags={','.join(worker.tags)} "
                f"metrics={metrics.url}"
            )

            def on_ready() -> None:
                print(ready, flush=True)

            if trainer is None:
                await rollout.run(stop, on_ready=on_ready)
            else:
                model = engine_config.model
                await _serve_with_trainer(
                    nc, run, provision, rollout, worker, trainer, model, metrics.url, stop, on_ready
                )
    finally:
        await loaded.close()
        metrics.close()
    print(f"worker {worker.worker_id} stopped", flush=True)


async def _serve_with_trainer(
    nc, run, provision, rollout, worker, trainer_config, model, metrics_url, stop, on_ready
) -> None:
    """One process, one registration, two parts: the rollout worker serves as ``rollout``, the
    trainer steps as ``train``. Switching stops one part before starting the other: taking
    ``train`` stops routing to the engine, aborts its generations (they continue elsewhere)
    and pauses it warm; giving ``train`` up lets the step in progress commit first."""
    from trainer.service import ServingWatch, Trainer, open_ranks

    names = RunNames(run)
    js = nc.jetstream()
    ranks, start = await open_ranks(model, trainer_config)
    try:
        registration = await Registration.open(
            js,
            names,
            worker.worker_id,
            tags=worker.tags,
            role=worker.role,
            capacity=worker.max_running,
            version=start.version if start else 0,
            metrics_url=metrics_url,
        )
        trainer = Trainer(
            js,
            names,
            trainer_config,
            ranks,
            registration,
            ServingWatch(provision.workers_ttl_s),
            start,
        )

        async def switch(role: Role) -> None:
            if role is Role.TRAIN:
                await rollout.take(Role.IDLE)
                await trainer.take(Role.TRAIN)
            else:
                await trainer.take(Role.IDLE)
                await rollout.take(role)

        roles = trainer.roles = RoleHolder(nc, names, registration, switch)
        await trainer.take(Role.TRAIN if worker.role is Role.TRAIN else Role.IDLE)
        await registration.put()
        await roles.start()
        heartbeat = asyncio.create_task(registration.keep_alive(worker.heartbeat_s, stop))

        async def part(coro) -> None:
            try:
                await coro
            finally:
                stop.set()  # one part ending ends the other

        try:
            outcomes = await asyncio.gather(
                part(trainer.serve(provision, stop)),
                part(rollout.run(stop, on_ready, registration=registration, roles=roles)),
                return_exceptions=True,
            )
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await roles.stop()
            await registration.delete()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
    finally:
        await asyncio.to_thread(ranks.close)


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
    workers: list[WorkerRegistered], leader: str | None, out=sys.stdout, now: float | None = None
) -> None:
    """The registry as a table (tags, role, epoch, version, heartbeat age), and the scheduler
    holding the run's lease."""
    now = time.time() if now is None else now
    rows = [("worker", "tags", "role", "epoch", "version", "busy", "heartbeat")]
    for w in workers:
        version = "-" if w.version is None else str(w.version)
        age = f"{max(0.0, now - w.heartbeat_at):.1f}s ago"
        row = (
            w.worker_id,
            ",".join(w.tags),
            w.role.value,
            str(w.epoch),
            version,
            "yes" if w.busy else "no",
            age,
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
