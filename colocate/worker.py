"""One process, one registration, two parts: the rollout worker serves as ``rollout``, the
trainer steps as ``train`` (as one rank of the trainer group, ``trainer.group``: several such
workers train together, and only the group's rank 0 takes samples). Switching stops one part
before starting the other: taking ``train`` stops routing to the engine, aborts its generations
(they continue elsewhere) and pauses it warm; giving ``train`` up lets the step in progress
commit first. An engine that takes tensors (hf) gets each version from the trainer in the
step; alone in the run, no file is written for it (``trainer.publisher``). Where it lends the
device's memory (``lends_memory``), the engine sleeps while it trains and the trainer's state
waits in host memory while it generates. A worker not tagged ``rollout`` only trains (a member
of a disaggregated layout's trainer group): it starts no engine."""

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial

from nats.aio.client import Client as NATS

from broker.client import session
from broker.config import ProvisionConfig
from broker.messages import Role
from broker.permissions import Principal
from broker.roles import membership
from broker.subjects import RunNames
from broker.worker_messages import has_tags
from common.metrics import serve_metrics
from rollout.engines import Engine, EngineConfig, start_engine
from rollout.engines.base import TakesTensors
from rollout.metrics import MEMORY_HANDOVER
from rollout.serve import METRICS, announce, worker_registration
from rollout.worker import RolloutWorker
from rollout.worker_config import WorkerConfig
from trainer.config import TrainerConfig
from trainer.group import GroupLink, rendezvous_host
from trainer.metrics import REGISTRY as TRAINER_METRICS
from trainer.publisher import InProcess
from trainer.ranks import uses_cuda
from trainer.serve import close_ranks, open_ranks
from trainer.service import Trainer
from trainer.watch import ServingWatch


@dataclass(frozen=True)
class Colocated:
    """A worker process that also holds the trainer (a worker tagged ``train``)."""

    url: str
    run: str
    provision: ProvisionConfig
    engine: EngineConfig
    worker: WorkerConfig
    trainer: TrainerConfig
    """The ``[trainer]`` section (its ``worker_id`` and ``tags`` unused: the process registers
    as the worker)."""
    metrics_port: int = 0


async def serve_colocated(c: Colocated, stop: asyncio.Event) -> None:
    """Run the worker and its trainer until ``stop`` (or until either part ends)."""
    lend = lends_memory(c)
    metrics = serve_metrics(*METRICS, TRAINER_METRICS, port=c.metrics_port)
    engine = await start_engine(c.engine) if has_tags(c.worker.tags, ["rollout"]) else None
    try:
        async with session(
            c.url,
            f"seamlessflow-worker-{c.worker.worker_id}",
            stop=stop,
            principal=Principal.TRAINER,
        ) as nc:
            await _serve(nc, c, engine, metrics.url, stop, lend)
    finally:
        if engine is not None:
            await engine.close()
        metrics.close()
    print(f"worker {c.worker.worker_id} stopped", flush=True)


async def _serve(
    nc: NATS,
    c: Colocated,
    engine: Engine | None,
    metrics_url: str,
    stop: asyncio.Event,
    lend: bool,
) -> None:
    names = RunNames(c.run)
    js = nc.jetstream()
    ranks, start = await open_ranks(c.engine.model, c.trainer)
    try:
        rollout = in_process = None
        if engine is not None:
            rollout = RolloutWorker(
                nc, names, engine, c.worker, c.provision.gen, nats_url=c.url, sleeps_idle=lend
            )
            await rollout.load_latest()
            if isinstance(engine, TakesTensors):  # each version straight from the trainer
                in_process = InProcess(c.worker.worker_id, rollout.take_weights)
        watch = ServingWatch(c.provision.workers_ttl_s)
        trainer = Trainer(js, names, c.trainer, ranks, watch, start, True, in_process)
        registration = await worker_registration(
            js,
            names,
            c.worker,
            version=trainer.version if rollout is None else rollout.version,
            metrics_url=metrics_url,
            trainer=c.trainer.shape(),
        )

        async def switch(role: Role) -> None:
            if rollout is None:  # only trains: train or idle
                await trainer.take(role)
            elif role is Role.TRAIN:
                await rollout.take(Role.IDLE)  # lending memory: the engine sleeps
                if lend:
                    with MEMORY_HANDOVER.labels("trainer_onload").time():
                        await asyncio.to_thread(ranks.onload)
                await trainer.take(Role.TRAIN)
            else:
                await trainer.take(Role.IDLE)  # the step in progress commits first
                if lend:
                    with MEMORY_HANDOVER.labels("trainer_offload").time():
                        await asyncio.to_thread(ranks.offload)
                await rollout.take(role)

        ready = partial(
            announce, c.run, c.engine, c.worker, metrics_url, serves=rollout is not None
        )
        async with membership(
            nc, names, registration, switch, heartbeat_s=c.worker.heartbeat_s
        ) as roles:
            link = GroupLink(
                js,
                names,
                c.worker.worker_id,
                rendezvous_host(),  # where the other members reach it
                trainer,
                ranks,
                c.trainer.collective_timeout_s,
                roles,
            )
            parts = [trainer.serve(c.provision, roles, stop), link.run(stop)]
            if rollout is None:
                ready()
            else:
                parts.append(rollout.run(roles, stop, ready))
            outcomes = await asyncio.gather(
                *(_part(part, stop) for part in parts), return_exceptions=True
            )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
    finally:
        await close_ranks(ranks)


def lends_memory(c: Colocated) -> bool:
    """``[worker] lend_memory``; unset: on where the trainer runs on CUDA with the torch backend
    (the one that can hand its memory over). The run config refuses it where it cannot be done
    whole (``RunConfig``)."""
    if c.worker.lend_memory is not None:
        return c.worker.lend_memory
    torch_backend = c.trainer.backend.kind == "torch"
    return uses_cuda(c.trainer) and torch_backend and c.trainer.world_size == 1


async def _part(part: Awaitable[None], stop: asyncio.Event) -> None:
    """Run one part; its end, normal or not, ends the other."""
    try:
        await part
    finally:
        stop.set()
