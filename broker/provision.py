"""Create a run's streams, durable consumers and buckets; idempotent, and loud on conflicts.

``plan`` is pure: it says what a run needs. ``provision_run`` makes the broker match it:
creates what is missing, leaves what already matches, and raises ``ProvisionConflictError``
naming every differing setting when something exists with another configuration.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    Placement,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue

from broker.config import ConsumerLimits, ProvisionConfig, StreamLimits
from broker.exceptions import BrokerError, ProvisionConflictError, RunNotProvisionedError
from broker.metrics import ConsumerStatus, StreamStatus
from broker.retry import retry
from broker.subjects import Durable, RunNames
from common.log import kv

log = logging.getLogger(__name__)

T = TypeVar("T")

KV_STREAM = "KV_{}"
OBJ_STREAM = "OBJ_{}"


@dataclass(frozen=True)
class ConsumerPlan:
    stream: str
    durable: str
    filter_subject: str
    limits: ConsumerLimits

    def config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.limits.ack_wait_s,
            max_deliver=self.limits.max_deliver,
            max_ack_pending=self.limits.max_ack_pending,
            filter_subject=self.filter_subject,
        )


@dataclass(frozen=True)
class RunPlan:
    """Everything one run needs on the broker."""

    names: RunNames
    streams: list[StreamConfig]
    consumers: list[ConsumerPlan]
    workers_kv: KeyValueConfig
    control_kv: KeyValueConfig
    state_kv: KeyValueConfig
    weights_store: ObjectStoreConfig
    bucket_streams: dict[str, dict[str, object]]
    """Settings of the KV and object-store streams that must match on re-provisioning."""


def _stream(
    cfg: ProvisionConfig,
    name: str,
    subjects: list[str],
    limits: StreamLimits,
    retention: RetentionPolicy = RetentionPolicy.LIMITS,
    per_subject: int = -1,
) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=subjects,
        retention=retention,
        storage=StorageType.FILE,
        num_replicas=cfg.replicas,
        placement=_placement(cfg),
        # A full work queue is a real backlog: refuse new messages (the publisher gets an
        # error) rather than silently drop unconsumed ones. Limits streams are history.
        discard=DiscardPolicy.NEW if retention is RetentionPolicy.WORK_QUEUE else DiscardPolicy.OLD,
        max_bytes=limits.max_bytes,
        max_age=limits.max_age_s,
        max_msg_size=limits.max_msg_size,
        max_msgs_per_subject=per_subject,
        duplicate_window=limits.duplicate_window_s,
    )


def _placement(cfg: ProvisionConfig) -> Placement | None:
    return Placement(cfg.placement.cluster, cfg.placement.tags) if cfg.placement else None


def plan(run: str, cfg: ProvisionConfig) -> RunPlan:
    """Everything the run ``run`` needs on the broker (a declarative table of it)."""
    n = RunNames(run)
    where = _placement(cfg)
    stream = partial(_stream, cfg)
    work = RetentionPolicy.WORK_QUEUE
    streams = [
        stream(n.tasks_stream, [n.tasks, n.tasks_admitted], cfg.tasks, work),
        stream(n.gen_stream, [n.gen_req], cfg.gen, work),
        stream(n.traj_stream, [n.traj_calls_all, n.traj_end], cfg.traj),
        stream(n.samples_stream, [n.samples], cfg.samples),
        stream(n.weights_stream, [n.weights], cfg.weights, per_subject=1),
        stream(n.dead_stream, [n.dead_all], cfg.dead),
    ]
    consumers = [
        ConsumerPlan(n.tasks_stream, Durable.SCHEDULER, n.tasks, cfg.scheduler),
        ConsumerPlan(n.tasks_stream, Durable.AGENTS, n.tasks_admitted, cfg.agents),
        ConsumerPlan(n.gen_stream, Durable.ROLLOUT, n.gen_req, cfg.rollout),
        ConsumerPlan(n.traj_stream, Durable.TRAJECTORY, n.traj_end, cfg.trajectory),
        ConsumerPlan(n.samples_stream, Durable.TRAINER, n.samples, cfg.trainer),
    ]
    workers_kv = KeyValueConfig(
        bucket=n.workers_kv,
        history=1,
        ttl=cfg.workers_ttl_s,
        replicas=cfg.replicas,
        placement=where,
    )
    control_kv = KeyValueConfig(
        bucket=n.control_kv, history=1, ttl=cfg.scheduler_lease_s, replicas=cfg.replicas
    )
    state_kv = KeyValueConfig(bucket=n.state_kv, history=1, replicas=cfg.replicas)
    weights_store = ObjectStoreConfig(
        bucket=n.weights_store,
        max_bytes=cfg.weights_store_max_bytes,
        replicas=cfg.replicas,
        placement=where,
    )
    bucket_streams = {
        KV_STREAM.format(n.workers_kv): {
            "max_age": cfg.workers_ttl_s,
            "max_msgs_per_subject": 1,
            "num_replicas": cfg.replicas,
        },
        KV_STREAM.format(n.control_kv): {
            "max_age": cfg.scheduler_lease_s,
            "max_msgs_per_subject": 1,
            "num_replicas": cfg.replicas,
        },
        KV_STREAM.format(n.state_kv): {
            "max_age": 0.0,
            "max_msgs_per_subject": 1,
            "num_replicas": cfg.replicas,
        },
        OBJ_STREAM.format(n.weights_store): {
            "max_bytes": cfg.weights_store_max_bytes,
            "num_replicas": cfg.replicas,
        },
    }
    return RunPlan(
        n, streams, consumers, workers_kv, control_kv, state_kv, weights_store, bucket_streams
    )


_STREAM_FIELDS = (
    "subjects",
    "retention",
    "storage",
    "num_replicas",
    "discard",
    "max_bytes",
    "max_age",
    "max_msg_size",
    "max_msgs_per_subject",
    "duplicate_window",
)
_CONSUMER_FIELDS = ("ack_policy", "ack_wait", "max_deliver", "max_ack_pending", "filter_subject")


def differences(what: str, actual: object, wanted: dict[str, object]) -> list[str]:
    """``what.field: exists as A, config asks B`` for each setting that differs."""
    out = []
    for key, want in wanted.items():
        have = getattr(actual, key, None)
        if isinstance(want, list) and isinstance(have, list):
            same = sorted(have) == sorted(want)
        elif isinstance(want, float) or isinstance(have, float):
            same = have is not None and abs(float(have) - float(want)) < 1e-3
        else:
            same = have == want
        if not same:
            out.append(f"{what}.{key}: exists as {have!r}, config asks {want!r}")
    return out


@dataclass
class ProvisionReport:
    created: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


async def provision_run(
    js: JetStreamContext, run: str, cfg: ProvisionConfig | None = None
) -> ProvisionReport:
    """Make the broker hold exactly what ``plan(run, cfg)`` describes."""
    p = plan(run, cfg or ProvisionConfig())
    report = ProvisionReport()
    conflicts: list[str] = []

    async def ensure(name: str, wanted: dict[str, object], create) -> None:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            await _create(name, create)
            report.created.append(name)
            return
        diff = differences(f"stream {name}", info.config, wanted)
        conflicts.extend(diff)
        if not diff:
            report.unchanged.append(name)

    for sc in p.streams:
        wanted = {k: getattr(sc, k) for k in _STREAM_FIELDS}
        await ensure(sc.name, wanted, lambda sc=sc: js.add_stream(sc))
    for bucket in (p.workers_kv, p.control_kv, p.state_kv):
        kv_stream = KV_STREAM.format(bucket.bucket)
        await ensure(
            kv_stream, p.bucket_streams[kv_stream], lambda b=bucket: js.create_key_value(b)
        )
    obj_stream = OBJ_STREAM.format(p.weights_store.bucket)
    await ensure(
        obj_stream,
        p.bucket_streams[obj_stream],
        lambda: js.create_object_store(p.weights_store.bucket, config=p.weights_store),
    )
    for cp in p.consumers:
        await _ensure_consumer(js, cp, report, conflicts)
    if conflicts:
        raise ProvisionConflictError(
            f"run {run!r} exists on this broker with another configuration:\n  "
            + "\n  ".join(conflicts)
            + "\nProvision it with the configuration it was created with, or use a new run name."
        )
    log.info(
        kv("run_provisioned", run=run, created=len(report.created), unchanged=len(report.unchanged))
    )
    return report


async def _create(what: str, create: Callable[[], Awaitable[object]]) -> None:
    try:
        await create()
    except APIError as exc:
        raise BrokerError(
            f"creating {what} failed: {exc.description} (JetStream error {exc.err_code}); "
            "what was created so far stays, and provisioning again resumes"
        ) from exc


async def _ensure_consumer(
    js: JetStreamContext, cp: ConsumerPlan, report: ProvisionReport, conflicts: list[str]
) -> None:
    label = f"consumer {cp.stream}/{cp.durable}"
    wanted_cfg = cp.config()
    try:
        info = await js.consumer_info(cp.stream, cp.durable)
    except NotFoundError:
        await _create(label, lambda: js.add_consumer(cp.stream, wanted_cfg))
        report.created.append(label)
        return
    wanted = {k: getattr(wanted_cfg, k) for k in _CONSUMER_FIELDS}
    diff = differences(label, info.config, wanted)
    conflicts.extend(diff)
    if not diff:
        report.unchanged.append(label)


@dataclass(frozen=True)
class RunStatus:
    run: str
    streams: list[StreamStatus]
    missing: list[str]


async def run_status(js: JetStreamContext, run: str) -> RunStatus:
    """Depth of every stream of the run (buckets included) and of its durable consumers."""
    p = plan(run, ProvisionConfig())
    names = [s.name for s in p.streams] + list(p.bucket_streams)
    streams, missing = [], []
    for name in names:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            missing.append(name)
            continue
        streams.append(await stream_status(js, info))
    return RunStatus(run, streams, missing)


async def stream_status(js: JetStreamContext, info: StreamInfo) -> StreamStatus:
    """A stream's depth and that of each of its consumers."""
    consumers = [
        ConsumerStatus(c.name, c.num_pending or 0, c.num_ack_pending or 0, c.num_redelivered or 0)
        for c in await js.consumers_info(info.config.name)
    ]
    return StreamStatus(info.config.name, info.state.messages, info.state.bytes, consumers)


async def run_stream_info(js: JetStreamContext, names: RunNames, stream: str) -> StreamInfo:
    """The info of one of the run's streams; ``RunNotProvisionedError`` when it is missing."""
    return await _provisioned(names, f"stream {stream}", js.stream_info(stream))


async def run_bucket(js: JetStreamContext, names: RunNames, bucket: str) -> KeyValue:
    """One of the run's KV buckets; ``RunNotProvisionedError`` when it is missing (a run
    provisioned before it was added: ``sf-<run>-state``)."""
    return await _provisioned(names, f"bucket {bucket}", js.key_value(bucket))


async def durable_info(
    js: JetStreamContext, names: RunNames, stream: str, durable: str, *, stop: asyncio.Event
) -> ConsumerInfo:
    """The info of one of the run's durable consumers; ``RunNotProvisionedError`` when it is
    missing. Long-running consumers call it before saying they are ready: a broker that is away
    (restarting) is waited for until ``stop``."""
    what = f"consumer {durable} on stream {stream}"
    return await retry(
        lambda: _provisioned(names, what, js.consumer_info(stream, durable)),
        what="durable_info",
        stop=stop,
    )


async def _provisioned(names: RunNames, what: str, lookup: Awaitable[T]) -> T:
    """``lookup``'s answer; if ``what`` (a part of the run) is missing, the one error that says
    so, naming the run and what to run."""
    try:
        return await lookup
    except NotFoundError as exc:
        raise RunNotProvisionedError(
            f"run {names.run!r} is not provisioned: no {what} "
            f"(run `seamlessflow provision --run {names.run}`)"
        ) from exc
