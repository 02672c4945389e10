"""The trajectory manager on the broker: ``SessionEnded`` in, ``SampleReady`` out.

For each ``SessionEnded`` (durable ``trajectory`` on ``traj.end``, through the validated
ingress) it reads that session's ``CallRecorded`` messages back from the traj stream
(``sf.<run>.traj.calls.<session>``, in stream order), builds the session's tree
(``trajectory.tree``) and publishes one ``SampleReady`` per sample with ``Nats-Msg-Id`` =
``sample_id``; only then does the ingress ack. It keeps no state: a redelivered ``SessionEnded``
rebuilds the same samples, which JetStream de-duplicates. The gateway stores a call's record
before it answers the agent, so every call of a session is on the stream when the session ends.

A call record that cannot be decoded (or names another session) is dead-lettered as a
``MessageRejected`` on ``sf.<run>.dead.trajectory``, counted, and left out; the rest of the
session is still built.

Every reward is checked before anything is built: a ``SessionEnded`` whose reward is NaN or
infinite is refused by the ingress's schema, one outside the run's ``rewards.range`` (the range
the agent runner scores within, ``common.rewards``) is dead-lettered with the reason, counted
(``sf_trajectory_sessions_total{outcome="reward_refused"}``) and logged; its session gives no
sample, and its group is trained without it once the trainer's ``group_timeout_s`` passes. So
a client that drives the gateway itself and publishes a bad reward is never trained on.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter, Histogram

from broker import codec
from broker.client import session
from broker.config import ProvisionConfig, StreamLimits
from broker.exceptions import InvalidMessageError
from broker.ingress import Delivery, Ingress, dead_letter
from broker.messages import CallRecorded, SessionEnded
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.permissions import Principal
from broker.provision import durable_info
from broker.subjects import Durable, RunNames
from common.exceptions import UnusableRewardError
from common.log import kv
from common.metrics import serve_metrics
from common.ready import announce_ready
from common.rewards import RewardsConfig, checked
from trajectory.config import TrajectoryConfig
from trajectory.tree import SessionBuild, build_session

log = logging.getLogger(__name__)

SOURCE = "trajectory"
"""The ingress name: dead letters go to ``sf.<run>.dead.trajectory``."""


REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

SESSIONS = Counter(
    "sf_trajectory_sessions",
    "Sessions ended, by outcome: sampled (samples published), no_calls (no call record on the "
    "stream), no_samples (calls, but no generated token to train on), reward_refused (a reward "
    "outside rewards.range: dead-lettered)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("sampled", "no_calls", "no_samples", "reward_refused"):  # exported at 0
    SESSIONS.labels(_outcome)
SAMPLES = Counter(
    "sf_trajectory_samples",
    "SampleReady publishes, by outcome: stored, or duplicate (already on the stream: a rebuilt "
    "session)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("stored", "duplicate"):  # every known label value exported from the start
    SAMPLES.labels(_outcome)
SAMPLES_SKIPPED = Counter(
    "sf_trajectory_samples_skipped",
    "Leaf paths not emitted because they hold no loss token (only context)",
    registry=REGISTRY,
)
TOKENS = Counter(
    "sf_trajectory_tokens",
    "Tokens of the samples built, by kind: loss (generated, in the loss mask) or context",
    ["kind"],
    registry=REGISTRY,
)
SHARED_TOKENS = Counter(
    "sf_trajectory_shared_tokens",
    "Call-record tokens that matched a token already in their session's tree (shared prefixes, "
    "stored once)",
    registry=REGISTRY,
)
GENERATED_SHARED = Counter(
    "sf_trajectory_generated_shared_tokens",
    "Generated tokens that matched a stored token (same token, same place) and kept its "
    "first writer's label",
    registry=REGISTRY,
)
CALLS = Counter(
    "sf_trajectory_calls",
    "Call records read back, by outcome: inserted, duplicate (a call id seen before in the "
    "session), invalid (undecodable or for another session: dead-lettered)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("inserted", "duplicate", "invalid"):  # exported from the start, at 0
    CALLS.labels(_outcome)
BUILD_SECONDS = Histogram(
    "sf_trajectory_session_build_seconds",
    "From a SessionEnded to its samples stored: reading calls, building, publishing",
    buckets=(5e-4, 1e-3, 2.5e-3, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)


class TrajectoryManager:
    """Turns ended sessions into samples. ``limits``: the run's traj stream limits."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        limits: StreamLimits,
        config: TrajectoryConfig,
        rewards: RewardsConfig | None = None,
    ) -> None:
        self._js = js
        self._reward_range = (rewards or RewardsConfig()).range
        self._names = names
        self._limits = limits
        self._ingress = Ingress(
            js,
            names,
            source=SOURCE,
            stream=names.traj_stream,
            durable=Durable.TRAJECTORY,
            schema=SessionEnded,
            handler=self._on_session_ended,
            max_payload=limits.max_payload,
            concurrency=config.concurrency,
        )

    async def run(self, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        """Handle ended sessions until ``stop`` is set; ``on_ready`` once the durable is found."""
        names = self._names
        await durable_info(self._js, names, names.traj_stream, Durable.TRAJECTORY, stop=stop)
        on_ready()
        await self._ingress.run(stop)

    async def _on_session_ended(self, end: SessionEnded, delivery: Delivery) -> None:
        started = time.perf_counter()
        # 1. Refuse a reward outside the run's range: the ingress dead-letters the end.
        self._check_reward(end)
        # 2. Read the session's call records back, in stream order.
        calls = await self._read_calls(end.session_id)
        # 3. Build its tree and samples (pure CPU work: off the event loop).
        built = await asyncio.to_thread(build_session, calls, end)
        # 4. Publish the samples; the ingress acks the SessionEnded after this returns.
        await self._publish(built)
        seconds = time.perf_counter() - started
        outcome = self._count(built, seconds)
        log.log(
            logging.INFO if outcome == "sampled" else logging.WARNING,
            kv(
                "session_built",
                session=end.session_id,
                outcome=outcome,
                calls=built.calls,
                duplicates=built.duplicate_calls,
                samples=len(built.samples),
                skipped=built.skipped_samples,
                stored_tokens=built.stored_tokens,
                loss_tokens=built.loss_tokens,
                seconds=f"{seconds:.3f}",
            ),
        )

    def _check_reward(self, end: SessionEnded) -> None:
        try:
            checked(end.reward, self._reward_range)
        except UnusableRewardError as exc:
            SESSIONS.labels("reward_refused").inc()
            reason = f"SessionEnded {end.session_id}: reward {exc.reason} (rewards.range)"
            log.warning(
                kv("session_refused", session=end.session_id, reason=exc.kind, error=exc.reason)
            )
            raise InvalidMessageError(reason) from exc

    async def _read_calls(self, session_id: str) -> list[CallRecorded]:
        subject = self._names.traj_calls(session_id)
        calls: list[CallRecorded] = []
        seq = 1
        while True:
            try:
                raw = await self._js.get_msg(
                    self._names.traj_stream, seq, subject=subject, next=True
                )
            except NotFoundError:
                return calls
            seq = raw.seq + 1
            try:
                calls.append(self._decode_call(raw, session_id))
            except InvalidMessageError as exc:
                await self._reject_call(raw, exc.reason)

    def _decode_call(self, raw: RawStreamMsg, session_id: str) -> CallRecorded:
        call = codec.decode(
            CallRecorded,
            raw.data or b"",
            content_type=codec.content_type_of(raw.headers),
            max_size=self._limits.max_payload,
        )
        if call.session_id != session_id:
            raise InvalidMessageError(
                f"CallRecorded {call.call_id} names session {call.session_id!r} but was stored "
                f"on the subject of session {session_id!r}"
            )
        return call

    async def _reject_call(self, raw: RawStreamMsg, reason: str) -> None:
        # A failed dead-letter publish raises: the SessionEnded is retried, nothing is lost.
        await dead_letter(
            self._js,
            self._names.dead(SOURCE),
            source=SOURCE,
            stream=self._names.traj_stream,
            stream_seq=raw.seq,
            subject=raw.subject,
            payload=raw.data or b"",
            content_type=codec.content_type_of(raw.headers),
            reason=reason,
        )
        CALLS.labels("invalid").inc()
        log.warning(
            kv(
                "call_record_rejected",
                subject=raw.subject,
                seq=raw.seq,
                dead_letter=self._names.dead(SOURCE),
                reason=reason,
            )
        )

    async def _publish(self, built: SessionBuild) -> None:
        for sample in built.samples:
            ack = await self._js.publish(
                self._names.samples,
                codec.encode(sample),
                headers=codec.headers(msg_id=sample.sample_id),
            )
            SAMPLES.labels("duplicate" if ack.duplicate else "stored").inc()

    @staticmethod
    def _count(built: SessionBuild, seconds: float) -> str:
        """Count the session in the metrics; return its outcome."""
        if built.samples:
            outcome = "sampled"
        elif built.calls:
            outcome = "no_samples"
        else:
            outcome = "no_calls"
        SESSIONS.labels(outcome).inc()
        CALLS.labels("inserted").inc(built.calls)
        CALLS.labels("duplicate").inc(built.duplicate_calls)
        SAMPLES_SKIPPED.inc(built.skipped_samples)
        TOKENS.labels("loss").inc(built.loss_tokens)
        TOKENS.labels("context").inc(built.context_tokens)
        SHARED_TOKENS.inc(built.shared_tokens)
        GENERATED_SHARED.inc(built.generated_shared)
        BUILD_SECONDS.observe(seconds)
        return outcome


async def serve_trajectory(
    url: str,
    run: str,
    provision: ProvisionConfig,
    config: TrajectoryConfig,
    rewards: RewardsConfig,
    metrics_port: int,
    stop: asyncio.Event,
) -> None:
    """Run the trajectory manager of ``run`` on the broker at ``url`` until ``stop`` is set."""
    metrics = serve_metrics(REGISTRY, INGRESS_METRICS, port=metrics_port)
    try:
        async with session(
            url,
            f"seamlessflow-trajectory-{run}",
            stop=stop,
            principal=Principal.TRAJECTORY,
        ) as nc:
            manager = TrajectoryManager(
                nc.jetstream(), RunNames(run), provision.traj, config, rewards
            )
            ready = partial(announce_ready, "trajectory", metrics.url, run=run)
            await manager.run(stop, on_ready=ready)
    finally:
        metrics.close()
    print("trajectory stopped", flush=True)
