"""The rollout worker process: engine, /metrics, membership of the run, then the worker loop."""

import asyncio
from functools import partial

from nats.js import JetStreamContext

from broker.client import session
from broker.config import ProvisionConfig
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.permissions import Principal
from broker.registry import Registration
from broker.roles import REGISTRY as ROLE_METRICS
from broker.roles import membership
from broker.subjects import RunNames
from broker.worker_messages import TrainerShape
from common.metrics import serve_metrics
from common.ready import announce_ready
from rollout.engines import EngineConfig, start_engine
from rollout.engines.base import REGISTRY as ENGINE_METRICS
from rollout.metrics import REGISTRY as WORKER_METRICS
from rollout.worker import RolloutWorker
from rollout.worker_config import WorkerConfig

METRICS = (WORKER_METRICS, ENGINE_METRICS, INGRESS_METRICS, ROLE_METRICS)
"""The registries a worker process serves on /metrics."""


async def worker_registration(
    js: JetStreamContext,
    names: RunNames,
    config: WorkerConfig,
    *,
    version: int,
    metrics_url: str,
    trainer: TrainerShape | None = None,
) -> Registration:
    """A worker's registry entry (not written yet): its tags, starting role, capacity, the
    version its engine serves and, when it holds the trainer too, the trainer's shape."""
    return await Registration.open(
        js,
        names,
        config.worker_id,
        tags=config.tags,
        role=config.role,
        capacity=config.max_running,
        version=version,
        metrics_url=metrics_url,
        trainer=trainer,
    )


def announce(
    run: str, engine: EngineConfig, config: WorkerConfig, metrics_url: str, *, serves: bool = True
) -> None:
    """Say the worker serves (``common.ready``); ``serves=False``: it started no engine."""
    tags = ",".join(config.tags)
    kind = engine.settings.kind if serves else "none"
    announce_ready(
        "worker",
        metrics_url,
        id=config.worker_id,
        engine=kind,
        model=engine.model,
        run=run,
        tags=tags,
    )


async def serve_worker(
    url: str,
    run: str,
    provision: ProvisionConfig,
    engine_config: EngineConfig,
    config: WorkerConfig,
    metrics_port: int,
    stop: asyncio.Event,
) -> None:
    """Run one rollout worker process until ``stop``."""
    metrics = serve_metrics(*METRICS, port=metrics_port)
    engine = await start_engine(engine_config)
    try:
        async with session(
            url,
            f"seamlessflow-worker-{config.worker_id}",
            stop=stop,
            principal=Principal.WORKER,
        ) as nc:
            names = RunNames(run)
            worker = RolloutWorker(nc, names, engine, config, provision.gen, nats_url=url)
            await worker.load_latest()
            registration = await worker_registration(
                nc.jetstream(), names, config, version=worker.version, metrics_url=metrics.url
            )
            ready = partial(announce, run, engine_config, config, metrics.url)
            async with membership(
                nc, names, registration, worker.take, heartbeat_s=config.heartbeat_s
            ) as roles:
                await worker.run(roles, stop, on_ready=ready)
    finally:
        await engine.close()
        metrics.close()
    print(f"worker {config.worker_id} stopped", flush=True)
