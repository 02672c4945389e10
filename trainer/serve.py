"""The trainer process: /metrics, every rank resumed from the newest checkpoint, membership of
the run with the trainer's shape in its registry entry, then the trainer's loop."""

import asyncio
import logging
from pathlib import Path

from broker.client import session
from broker.config import ProvisionConfig
from broker.messages import Role
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.permissions import Principal
from broker.registry import Registration
from broker.roles import REGISTRY as ROLE_METRICS
from broker.roles import membership
from broker.subjects import RunNames
from common.log import kv
from common.metrics import serve_metrics
from common.ready import announce_ready
from trainer import checkpoint
from trainer.checkpoint import Checkpoint
from trainer.config import TrainerConfig
from trainer.metrics import REGISTRY
from trainer.ranks import RankGroup, set_threads
from trainer.service import Trainer
from trainer.watch import ServingWatch

log = logging.getLogger(__name__)


async def open_ranks(model: Path, config: TrainerConfig) -> tuple[RankGroup, Checkpoint | None]:
    """Every rank built and resumed from the newest checkpoint, if any (off the event loop)."""
    set_threads(config)
    ranks = await asyncio.to_thread(RankGroup, model, config)
    start, path = None, None
    try:
        if config.checkpoint_dir is not None:
            path = checkpoint.latest_path(config.checkpoint_dir)
            start = await asyncio.to_thread(checkpoint.load_file, path) if path else None
        await asyncio.to_thread(ranks.load, start, path)
        if start is not None:
            # The process may have died between a checkpoint and its line in the steps log.
            await asyncio.to_thread(checkpoint.append_steps, config.checkpoint_dir, start.recent)
    except BaseException:
        await asyncio.to_thread(ranks.close)
        raise
    return ranks, start


async def close_ranks(ranks: RankGroup) -> None:
    """Stop every rank; a failure is logged, so that it never hides why the trainer stopped."""
    try:
        await asyncio.to_thread(ranks.close)
    except Exception as exc:
        log.error(kv("ranks_close_failed", error=f"{type(exc).__name__}: {exc}"))


async def serve_trainer(
    url: str,
    run: str,
    provision: ProvisionConfig,
    config: TrainerConfig,
    model: Path,
    metrics_port: int,
    stop: asyncio.Event,
) -> None:
    """Run the trainer (all its ranks) until ``stop``: /metrics, ranks, checkpoint, NATS."""
    metrics = serve_metrics(REGISTRY, INGRESS_METRICS, ROLE_METRICS, port=metrics_port)
    ranks, start = await open_ranks(model, config)
    try:
        async with session(
            url,
            f"seamlessflow-{config.worker_id}",
            stop=stop,
            principal=Principal.TRAINER,
        ) as nc:
            js = nc.jetstream()
            names = RunNames(run)
            watch = ServingWatch(provision.workers_ttl_s)
            trainer = Trainer(js, names, config, ranks, watch, start)
            registration = await Registration.open(
                js,
                names,
                config.worker_id,
                tags=config.tags,
                role=Role.TRAIN,
                version=trainer.version,
                metrics_url=metrics.url,
                trainer=config.shape(),
            )

            def ready() -> None:
                announce_ready("trainer", metrics.url, run=run, version=trainer.version)

            async with membership(
                nc, names, registration, trainer.take, heartbeat_s=config.heartbeat_s
            ) as roles:
                await trainer.serve(provision, roles, stop, on_ready=ready)
    finally:
        await close_ranks(ranks)
        metrics.close()
    print("trainer stopped", flush=True)
