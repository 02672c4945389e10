"""The rollout worker: generation requests from the ``gen.req`` work queue into an engine, token
chunks back to the requester, weight versions followed as they are published
(``rollout.following``).

Per request (``GenerationRequested``), the worker streams ``TokensGenerated`` chunks to the
request's ``reply_to``: seq 0 at once (it may be empty: "started"), then the engine's tokens,
each chunk labelled with the weight version that produced it, and an empty keepalive chunk
whenever nothing was sent for ``keepalive_s``. Tokens go at once when none went in the last
``stream_interval_s``; the ones that follow within it wait and go together (and the last ones
with the finish reason), so a call costs a few messages instead of one per token: each message
wakes the broker and the gateway, and on a small machine that slows the engine itself. A request
not ``streamed`` (the requester reads only the whole response) has its tokens held until the
finish, a new weight version, or the keepalive, which sends them instead of an empty chunk. The
JetStream message is kept in progress while the request runs and acknowledged only when it is
done. The worker takes requests from the queue only while fewer than ``max_waiting`` of its
attempts have no token from the engine yet (queued in the engine, e.g. for KV cache), and only
while none has once the engine is full (``rollout.intake``): a backlog waits on the shared queue
for whichever engine has room, not in one engine's queue. A request ends with the engine's
finish reason; an attempt the worker gives up (it is stopping, or the gateway cancelled it) ends
with ``ABORT`` and the reason in ``error``, and the gateway continues the call elsewhere.

The worker loads the newest published version first (``load_latest``), so that the registry
entry it is registered with carries it; whoever opens the membership (``broker.roles``) gives
``run`` its ``RoleHolder``.

Roles (``broker.roles``): the worker starts in ``WorkerConfig.role`` and the scheduler moves it
between ``rollout`` (consuming ``gen.req``) and ``idle``. Going idle stops routing to it (the
ingress hands back what it fetched), aborts what is in flight (the gateway continues those
attempts elsewhere with their tokens and versions: partial rollout) and pauses the engine warm:
weights stay loaded and keep following new versions, so it rejoins serving the current one.
"""

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from broker import codec
from broker.config import StreamLimits
from broker.exceptions import InvalidMessageError
from broker.ingress import Delivery, HandBack, Ingress
from broker.messages import (
    FinishReason,
    GenerationCancelled,
    GenerationRequested,
    Role,
    TokensGenerated,
)
from broker.roles import RoleHolder
from broker.subjects import Durable, RunNames
from common.log import kv
from rollout.engines import Engine, EngineError, GenerationChunk
from rollout.following import WeightFollower
from rollout.intake import Intake
from rollout.metrics import (
    INTAKE_LIMITED,
    INTERRUPTIONS,
    MEMORY_HANDOVER,
    QUEUE_WAIT,
    REQUESTS,
    RUNNING,
    TOKENS,
    WAITING,
)
from rollout.worker_config import WorkerConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 0.5
"""How long the ingress's fetch waits for requests; a lend does not wait for it (``take``)."""


@dataclass
class _Attempt:
    """One request in progress: its reply subject and the numbering of its chunks."""

    request: GenerationRequested
    delivery: Delivery
    seq: int = 0
    last_sent: float = field(default_factory=time.monotonic)
    abort_reason: str | None = None
    held: GenerationChunk | None = None
    """Tokens generated but not sent yet (one weight version): they go with the next ones."""
    tokens_sent_at: float = -math.inf
    flusher: asyncio.Task | None = None
    """Sends ``held`` when ``stream_interval_s`` has passed, if nothing else sent it first."""
    engine_s: float | None = None
    """Set when the engine ended the attempt: its seconds, from the call into it."""
    started: bool = False
    """The engine has sent something for it (it is no longer queued in the engine)."""
    handed_at: float = math.inf
    """When it was handed to the engine (monotonic)."""
    tokens_at: float | None = None
    """When the engine's last tokens for it came (monotonic)."""


class RolloutWorker:
    def __init__(
        self,
        nc: NATS,
        names: RunNames,
        engine: Engine,
        config: WorkerConfig,
        gen_limits: StreamLimits,
        *,
        nats_url: str,
        sleeps_idle: bool = False,
    ) -> None:
        self._nc = nc
        self._sleeps_idle = sleeps_idle  # a colocated worker lending the device's memory
        self._asleep = False
        self._js = nc.jetstream()
        self._names = names
        self._engine = engine
        self._config = config
        self._gen_limits = gen_limits
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._stopping = False
        self._roles: RoleHolder | None = None  # set by run
        self._serving: asyncio.Task | None = None  # the gen.req ingress, while rollout
        self._ingress: Ingress[GenerationRequested] | None = None  # the one ``_serving`` runs
        self._waiting = 0  # attempts the engine has not started
        self._intake = Intake(config.max_waiting)
        self._serving_stop = asyncio.Event()
        self._ending: asyncio.Task | None = None  # an ingress stopped (lent) and not ended yet
        self._engine_lock = asyncio.Lock()  # a role switch never resumes a load in progress
        self._weights = WeightFollower(
            self._js, names, engine, config, self, self._engine_lock, nats_url=nats_url
        )

    @property
    def worker_id(self) -> str:
        return self._config.worker_id

    @property
    def version(self) -> int:
        """The weight version the engine serves."""
        return self._engine.version

    def requests_ingress(self) -> Ingress[GenerationRequested]:
        """The validated ingress of the run's generation requests, handled by this worker."""
        return Ingress(
            self._js,
            self._names,
            source="gen",
            stream=self._names.gen_stream,
            durable=Durable.ROLLOUT,
            schema=GenerationRequested,
            handler=self._generate,
            max_payload=self._gen_limits.max_payload,
            batch=self._config.max_running,
            concurrency=self._config.max_running,
            room=self._room,
            fetch_timeout=FETCH_TIMEOUT_S,
        )

    async def load_latest(self) -> None:
        """Load the newest published weights, before registering (the entry carries them)."""
        await self._weights.load_latest()

    async def take_weights(self, version: int, tensors: "Mapping[str, torch.Tensor]") -> bool:
        """``version`` handed over in this process (``WeightFollower.take``): served now?"""
        return await self._weights.take(version, tensors)

    async def run(
        self, roles: RoleHolder, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None
    ) -> None:
        """Follow cancellations and weight versions and serve as ``roles`` says until ``stop``;
        then interrupt what is in flight. ``roles`` belongs to whoever opened the membership
        (``broker.roles.membership``), which has applied the first role already. ``on_ready``
        is called once the worker follows everything."""
        self._roles = roles
        cancels = await self._nc.subscribe(self._names.gen_cancel_all, cb=self._on_cancel)
        weights = await self._weights.follow(roles.registration)
        log.info(kv("worker_started", worker=self.worker_id, role=roles.role, version=self.version))
        on_ready()
        try:
            await stop.wait()
        finally:
            # Stop taking requests, end the ones in flight (the gateway continues them).
            self._stopping = True
            await self._stop_serving("interrupted: worker stopping", cause="stopping")
            await cancels.unsubscribe()
            await weights.unsubscribe()
            log.info(kv("worker_stopped", worker=self.worker_id))

    # -- roles ------------------------------------------------------------------------------
    async def take(self, role: Role) -> None:
        """``RoleHolder``'s switch: serve ``gen.req`` as ``rollout``, nothing as ``idle``. Where
        ``sleeps_idle``, the engine sleeps while idle (its device memory handed over to
        training) and loads no weights; the reclaim wakes it and loads the newest version."""
        if role not in (Role.ROLLOUT, Role.IDLE):
            raise ValueError(f"a rollout worker cannot hold the role {role.value!r}")
        if role is Role.IDLE:  # first stop routing and abort: never wait for responses
            await self._stop_serving("interrupted: worker reclaimed", cause="reclaimed", wait=False)
        elif self._asleep:
            async with self._engine_lock:
                with MEMORY_HANDOVER.labels("engine_wake").time():
                    await self._engine.wake()
                self._asleep = False
            await self._weights.load_latest()  # a version published while it slept
        async with self._engine_lock:
            if role is Role.ROLLOUT:
                await self._engine.resume()
                await self._start_serving()
            else:
                await self._engine.pause()
                if self._sleeps_idle and not self._asleep:
                    with MEMORY_HANDOVER.labels("engine_sleep").time():
                        await self._engine.sleep()
                    self._asleep = True

    async def _start_serving(self) -> None:
        if self._ending is not None:  # reclaimed before the last ingress ended: one at a time
            ending, self._ending = self._ending, None
            await ending
        if self._serving is None and not self._stopping and not self._weights.quarantined:
            self._serving_stop = asyncio.Event()
            self._ingress = self.requests_ingress()
            self._serving = asyncio.create_task(self._ingress.run(self._serving_stop))

    async def _stop_serving(self, reason: str, *, cause: str, wait: bool = True) -> None:
        """Stop routing to this worker, then abort what is in flight; never wait for responses.
        ``wait``: also wait for the ingress to end (the fetch it has pending, up to its
        ``fetch_timeout``, then the handlers of what it holds). A lend does not: the ingress ends
        by itself, handing back whatever its last fetch brings, and serving again waits for it
        first."""
        if self._serving is not None:
            serving, self._serving = self._serving, None
            self._serving_stop.set()
            for attempt in list(self._attempts.values()):
                await self._abort(attempt, reason, cause=cause)
            self._ending = serving
        if wait and self._ending is not None:
            ending, self._ending = self._ending, None
            await ending

    # -- requests ---------------------------------------------------------------------------
    async def _generate(self, request: GenerationRequested, delivery: Delivery) -> None:
        key = (request.call_id, request.attempt)
        if self._stopping or self._serving is None:  # fetched while stopping or going idle
            raise HandBack(f"attempt {key}: {self.worker_id} is stopping or no longer serving")
        if key in self._attempts:
            # A duplicate delivery of an attempt running here: that run answers its reply_to.
            log.info(kv("duplicate_request", call=request.call_id, attempt=request.attempt))
            return
        attempt = _Attempt(request, delivery)
        self._attempts[key] = attempt
        self._waiting += 1
        WAITING.inc()
        self._note_busy()
        QUEUE_WAIT.observe(max(0.0, time.time() - delivery.published_at))
        RUNNING.inc()
        keepalive = asyncio.create_task(self._keepalive(attempt))
        finish = FinishReason.ERROR
        try:
            await self._send(attempt, GenerationChunk([], [], self._engine.version))
            called = time.monotonic()  # the engine's seconds: from here to its last chunk
            attempt.handed_at = called
            stream = self._engine.generate(_request_id(request), request.prompt_ids, request.params)
            async for chunk in stream:
                self._engine_sent(attempt, chunk)
                TOKENS.inc(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    attempt.engine_s = time.monotonic() - called
                error = None
                if chunk.finish_reason is FinishReason.ABORT:
                    error = attempt.abort_reason or "aborted by the engine"
                await self._forward(attempt, chunk, error)
                finish = chunk.finish_reason or finish
        except EngineError as exc:
            log.warning(kv("generation_failed", call=request.call_id, error=exc))
            attempt.engine_s = time.monotonic() - called
            final = GenerationChunk([], [], self._engine.version, FinishReason.ERROR)
            await self._forward(attempt, final, str(exc))
        finally:
            keepalive.cancel()
            if attempt.flusher is not None:
                attempt.flusher.cancel()
            del self._attempts[key]
            self._started(attempt)
            self._note_busy()
            RUNNING.dec()
            REQUESTS.labels(finish.value).inc()

    def _room(self) -> int:
        """How many more requests to take (``rollout.intake``)."""
        now = time.monotonic()
        waited = [now - a.handed_at for a in self._attempts.values() if not a.started]
        oldest = max(waited, default=0.0)
        INTAKE_LIMITED.set(self._intake.limited(oldest))
        return self._intake.room(self._waiting, oldest)

    def _engine_sent(self, attempt: _Attempt, chunk: GenerationChunk) -> None:
        """The engine's ``chunk`` for ``attempt`` came: how long it waited to start, and the
        engine's step (``rollout.intake``)."""
        if chunk.token_ids:
            now = time.monotonic()
            if attempt.tokens_at is None:
                self._intake.started(now - attempt.handed_at)
            else:
                self._intake.decoded(len(chunk.token_ids), now - attempt.tokens_at)
            attempt.tokens_at = now
        self._started(attempt)

    def _started(self, attempt: _Attempt) -> None:
        """The engine has started ``attempt`` (or it ended): one fewer waiting, room to take one."""
        if attempt.started:
            return
        attempt.started = True
        self._waiting -= 1
        WAITING.dec()
        if self._ingress is not None:
            self._ingress.wake()

    async def _forward(self, attempt: _Attempt, chunk: GenerationChunk, error: str | None = None):
        """Send the engine's ``chunk`` (with any tokens held before it) now, or hold its tokens
        for at most ``stream_interval_s`` after the last tokens sent; for a request not
        ``streamed``, until the keepalive. A chunk that ends the attempt always goes at once; a
        new weight version first sends what the old one made."""
        if not chunk.token_ids and chunk.finish_reason is None:
            return  # nothing to tell
        held = attempt.held
        if held is not None and held.version != chunk.version:
            await self._send_held(attempt)
            held = None
        if held is not None:
            chunk = GenerationChunk(
                held.token_ids + chunk.token_ids,
                held.logprobs + chunk.logprobs,
                chunk.version,
                chunk.finish_reason,
            )
        attempt.held = chunk
        if chunk.finish_reason is not None:
            await self._send_held(attempt, error)
        elif attempt.request.streamed:
            wait = attempt.tokens_sent_at + self._config.stream_interval_s - time.monotonic()
            if wait <= 0:
                await self._send_held(attempt)
            elif attempt.flusher is None:
                attempt.flusher = asyncio.create_task(self._send_held_after(attempt, wait))

    async def _send_held_after(self, attempt: _Attempt, delay: float) -> None:
        await asyncio.sleep(delay)
        attempt.flusher = None
        if attempt.held is not None:
            await self._send_held(attempt)

    async def _send_held(self, attempt: _Attempt, error: str | None = None) -> None:
        """Send the held tokens now. Taking them, numbering the chunk and queueing it on the
        connection happen without a pause, so chunks leave in ``seq`` order."""
        chunk, attempt.held = attempt.held, None
        assert chunk is not None
        if attempt.flusher is not None:  # not the flusher itself: it clears this first
            attempt.flusher.cancel()
            attempt.flusher = None
        if chunk.token_ids:
            attempt.tokens_sent_at = time.monotonic()
        await self._send(attempt, chunk, error)

    async def _send(self, attempt: _Attempt, chunk: GenerationChunk, error: str | None = None):
        message = TokensGenerated(
            call_id=attempt.request.call_id,
            attempt=attempt.request.attempt,
            seq=attempt.seq,
            worker_id=self.worker_id,
            version=chunk.version,
            token_ids=chunk.token_ids,
            logprobs=chunk.logprobs,
            finish_reason=chunk.finish_reason,
            error=error[:4096] if error else None,
            engine_s=attempt.engine_s if chunk.finish_reason is not None else None,
        )
        attempt.seq += 1
        attempt.last_sent = time.monotonic()
        await self._nc.publish(attempt.request.reply_to, codec.encode(message))
        if chunk.finish_reason is not None:
            # The caller waits for this one. The connection writes on its next loop turn: let
            # it, before the attempt's bookkeeping and ack (which would hold it 0.4 ms here).
            await asyncio.sleep(0)

    async def _keepalive(self, attempt: _Attempt) -> None:
        """Keep the message from being redelivered, and the requester from thinking we died:
        after ``keepalive_s`` without a chunk, send the tokens held, or an empty chunk."""
        period = self._config.keepalive_s
        while True:
            await asyncio.sleep(period / 2)
            try:
                await attempt.delivery.in_progress()
                if time.monotonic() - attempt.last_sent < period:
                    continue
                if attempt.held is not None:
                    await self._send_held(attempt)
                else:
                    await self._send(attempt, GenerationChunk([], [], self._engine.version))
            except NatsError as exc:
                log.warning(kv("keepalive_failed", call=attempt.request.call_id, error=exc))

    async def _abort(self, attempt: _Attempt, reason: str, *, cause: str) -> None:
        if attempt.abort_reason is None:
            attempt.abort_reason = reason
            INTERRUPTIONS.labels(cause).inc()
            await self._engine.abort(_request_id(attempt.request))

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = codec.decode(GenerationCancelled, msg.data)
        except InvalidMessageError as exc:
            log.warning(kv("bad_cancel", subject=msg.subject, error=exc.reason))
            return
        if attempt := self._attempts.get((cancel.call_id, cancel.attempt)):
            await self._abort(attempt, f"cancelled: {cancel.reason}", cause="cancelled")

    # -- what weight loads need (rollout.following.Served) ---------------------------------------
    def serving(self) -> bool:
        return self._serving is not None

    def in_flight(self) -> int:
        return len(self._attempts)

    def lent(self) -> bool:
        return self._asleep

    async def quarantine(self) -> None:
        await self._stop_serving("interrupted: worker quarantined", cause="quarantined")

    async def rejoin(self) -> None:
        if self._roles is not None and self._roles.role is Role.ROLLOUT:
            async with self._engine_lock:
                await self._engine.resume()
                await self._start_serving()

    def _note_busy(self) -> None:
        if self._roles is not None:
            self._roles.set_busy(bool(self._attempts))


def _request_id(request: GenerationRequested) -> str:
    return f"{request.call_id}-{request.attempt}"
