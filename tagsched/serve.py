"""The scheduler process: /metrics, then a scheduler (``tagsched.scheduler``, active once it
holds the lease) until stopped."""

import asyncio
from functools import partial

from broker.client import session
from broker.config import ProvisionConfig
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.permissions import Principal
from broker.provision import durable_info
from broker.subjects import Durable, RunNames
from broker.worker_messages import TrainerShape
from common.metrics import serve_metrics
from common.ready import announce_ready
from tagsched.admission import Admission, admission_limit
from tagsched.config import LayoutConfig, SchedulerConfig
from tagsched.metrics import REGISTRY
from tagsched.scheduler import Scheduler


async def serve_scheduler(
    url: str,
    run: str,
    provision: ProvisionConfig,
    config: SchedulerConfig,
    layout: LayoutConfig,
    shape: TrainerShape | None,
    metrics_port: int,
    stop: asyncio.Event,
) -> None:
    """Run a scheduler (active once it holds the lease) until ``stop``: /metrics, NATS.
    ``shape``: the trainer's as this scheduler's config has it, if it has one (its admission
    limit is checked at once; admission follows the registered trainer's)."""
    limit = None
    if shape is not None:
        limit = admission_limit(
            steps_ahead=config.steps_ahead,
            groups_per_step=shape.groups_per_step,
            max_staleness=shape.max_staleness,
        )
    metrics = serve_metrics(REGISTRY, INGRESS_METRICS, port=metrics_port)
    try:
        async with session(
            url,
            f"seamlessflow-{config.scheduler_id}",
            stop=stop,
            principal=Principal.SCHEDULER,
        ) as nc:
            js = nc.jetstream()
            names = RunNames(run)
            await durable_info(js, names, names.tasks_stream, Durable.SCHEDULER, stop=stop)
            admission = Admission(js, names, provision.tasks)
            scheduler = Scheduler(
                nc,
                names,
                config,
                layout.spec(),
                admission,
                workers_ttl_s=provision.workers_ttl_s,
                lease_s=provision.scheduler_lease_s,
                configured=shape,
            )

            ready = partial(
                announce_ready, "scheduler", metrics.url, run=run, layout=layout.kind, limit=limit
            )
            await scheduler.run(stop, on_ready=ready)
    finally:
        metrics.close()
    print("scheduler stopped", flush=True)
