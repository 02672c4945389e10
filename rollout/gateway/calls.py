"""One LLM call run over NATS per the generation protocol (docs/protocol.md, generation).

A ``Call`` is one OpenAI choice. It subscribes to its ``gen.out`` subject, publishes
``GenerationRequested`` to the gen work queue, and yields the tokens that rollout workers stream
back. When an attempt is interrupted (the worker aborted it, went silent for
``stall_timeout_s`` after starting, a chunk went missing, or its request left the queue with no
chunk ever arriving) the call cancels that attempt,
deletes its request from the queue and publishes the next attempt with the tokens so far
appended to the prompt, so the caller sees one unbroken stream. When the call ends it publishes
a token-exact ``CallRecorded`` to the trajectory stream.

Every NATS operation has a timeout, and a call notices a lost connection within
``nats_timeout_s``: the broker going away turns into ``GenerationUnavailableError``, never a hang.
A broker still connected but slow to store a request (a publish timed out) is asked again.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import pairwise

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from broker import codec
from broker.exceptions import InvalidMessageError, RetryStoppedError
from broker.messages import (
    CallRecorded,
    FinishReason,
    GenerationCancelled,
    GenerationRequested,
    SamplingParams,
    TokensGenerated,
)
from broker.retry import retry
from broker.subjects import RunNames
from common.log import kv
from rollout.exceptions import (
    GenerationFailedError,
    GenerationUnavailableError,
    RecordUnavailableError,
)

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

ERRORS = Counter(
    "sf_gateway_errors",
    "Gateway errors by type: invalid_request, model_not_found, context_length_exceeded, "
    "unavailable (broker or workers), generation_failed, client_disconnected, invalid_chunk "
    "(a worker chunk that does not decode), record_failed (a call record could not be stored; "
    "its response was withheld)",
    ["type"],
    registry=REGISTRY,
)
for _type in (  # the documented types, exported from the start at 0
    "invalid_request",
    "model_not_found",
    "context_length_exceeded",
    "unavailable",
    "generation_failed",
    "client_disconnected",
    "invalid_chunk",
    "record_failed",
):
    ERRORS.labels(_type)
CONTINUATIONS = Counter(
    "sf_gateway_continuations",
    "Attempts continued on another worker, by reason: abort, stall, gap, lost (the request was "
    "taken and acked but no chunk of it arrived: a worker cut off from this gateway), restart "
    "(its worker, restarted, was handed it again)",
    ["reason"],
    registry=REGISTRY,
)
for _reason in ("abort", "stall", "gap", "lost", "restart"):  # exported from the start, at 0
    CONTINUATIONS.labels(_reason)
CALL_SECONDS = Histogram(
    "sf_gateway_call_seconds",
    "Duration of a call from its first request to its last token, by finish reason",
    ["finish_reason"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)

OVERHEAD_SECONDS = Histogram(
    "sf_gateway_overhead_seconds",
    "What the data plane added to a call ended by its engine (stop or length): its duration "
    "less the engines' own seconds on it (CallRecorded.engine_s)",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5),
    registry=REGISTRY,
)

OPEN = Gauge(
    "sf_gateway_calls_open",
    "Calls in progress: from their request's publication (queued or running) to their record",
    registry=REGISTRY,
)

RECORD_ATTEMPTS = 3
"""Publishes of a CallRecorded (0.5 s, then 1 s apart) before the call fails."""

_POLL_S = 0.25
"""How often a waiting call looks at the connection."""
_GONE_LOOKS = 2
"""Looks ``stall_timeout_s`` apart that must find a request gone before its attempt is lost."""


class CallLimits(BaseModel):
    """How long a call waits, and how often it is continued."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stall_timeout_s: float = Field(
        default=5.0, gt=0, description="continue an attempt silent this long after it started"
    )
    queue_timeout_s: float = Field(
        default=600.0, gt=0, description="fail (503) an attempt no worker started within this"
    )
    max_attempts: int = Field(default=8, ge=1, description="attempts per call, then 503")
    nats_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="timeout of each NATS request; a call fails (503) when the connection "
        "stays down this long",
    )


@dataclass(frozen=True)
class Tokens:
    """New tokens of a call, in order, with their logprobs."""

    ids: list[int]
    logprobs: list[float]


@dataclass
class _Attempt:
    number: int
    stream_seq: int
    started_at: float
    next_seq: int = 0
    last_chunk_at: float | None = None
    """None until the attempt's first chunk arrived."""
    checked_at: float = 0.0
    """When the request was last looked for on the gen queue (until the first chunk)."""
    gone: int = 0
    """Looks in a row that found the request gone from the queue with no chunk received."""
    worker_id: str | None = None
    """The worker whose chunks the attempt takes: the one that sent its first chunk."""


class Call:
    """One generation, continued across interruptions: ``start``, iterate ``tokens()``, and
    always ``close``."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        names: RunNames,
        model: str,
        limits: CallLimits,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        streamed: bool = True,
    ) -> None:
        self.nc, self.js, self.names, self.model, self.limits = nc, js, names, model, limits
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.streamed = streamed
        """False: only the whole response is read (``GenerationRequested.streamed``)."""
        self.call_id = uuid.uuid4().hex
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_versions: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.continuations = 0
        self.engine_s: float | None = None
        """The engines' seconds on the call, summed over the attempts that told it."""
        self._timed_end = False
        """The engine ended the call (stop or length), telling its seconds."""
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._attempt: _Attempt | None = None
        self._ready: list[Tokens] = []
        self._started_at = 0.0
        self._taken = False
        """Some attempt sent its first chunk: a worker ran the call."""
        self._cancel_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def start(self) -> None:
        """Subscribe, publish attempt 0 and wait until a worker starts it. When none does, the
        request is off the queue before the error is raised: no worker starts it afterwards."""
        self._started_at = time.time()
        OPEN.inc()
        _check_connected(self.nc)
        self._sub = await self.nc.subscribe(self.names.gen_out(self.call_id), cb=self._queue.put)
        await self._publish_attempt(0)
        try:
            while not self._taken and not self.finished:
                tokens = await self._step()
                if tokens is not None:
                    self._ready.append(tokens)
        except Exception:
            if not self._taken and self._attempt is not None:
                await self._cancel_attempt("not started")
                self._attempt = None  # withdrawn: ``close`` has nothing left to cancel
            raise

    async def tokens(self) -> AsyncIterator[Tokens]:
        """The call's tokens as they arrive, until it finishes."""
        while self._ready:
            yield self._ready.pop(0)
        while not self.finished:
            tokens = await self._step()
            if tokens is not None:
                yield tokens

    def end(self, keep: int, reason: str) -> None:
        """Finish now with STOP, keeping the first ``keep`` output tokens (e.g. the last one
        completed a stop string); the running attempt is cancelled on ``close``."""
        del self.output_ids[keep:], self.output_logprobs[keep:], self.output_versions[keep:]
        self.finish_reason = FinishReason.STOP
        self._cancel_reason = reason

    async def close(self) -> None:
        """Cancel what still runs (an unfinished call ends with ABORT), stop listening, and
        publish the call's record if a worker ever took it (``GenerationUnavailableError`` if it
        cannot be stored)."""
        try:
            if not self.finished:
                self.finish_reason = FinishReason.ABORT
                self._cancel_reason = "call abandoned"
            if self._cancel_reason is not None and self._attempt is not None:
                await self._cancel_attempt(self._cancel_reason)
            if self._sub is not None:
                await _quietly(self._sub.unsubscribe())
            if self._taken:
                await self._record()
        finally:
            OPEN.dec()

    # -- one event ------------------------------------------------------------------------

    async def _step(self) -> Tokens | None:
        """Handle one chunk or timeout; return the new tokens it brought, if any."""
        attempt = self._attempt
        assert attempt is not None
        msg = await self._next_message(attempt)
        if msg is None:
            await self._continue("lost" if attempt.gone >= _GONE_LOOKS else "stall")
            return None
        try:
            content_type = codec.content_type_of(msg.headers)
            chunk = codec.decode(TokensGenerated, msg.data, content_type=content_type)
        except InvalidMessageError as exc:
            ERRORS.labels("invalid_chunk").inc()
            log.warning(kv("gateway_invalid_chunk", call=self.call_id, reason=exc.reason))
            return None
        if chunk.attempt != attempt.number:
            return None  # an older attempt
        if attempt.worker_id not in (None, chunk.worker_id):
            return None  # a second worker was handed the same request (delivered again)
        if chunk.seq == 0 and attempt.next_seq > 0:  # it started again: a new life of the worker
            await self._continue("restart")
            return None
        if chunk.seq < attempt.next_seq:
            return None  # a duplicate
        attempt.worker_id = chunk.worker_id
        if chunk.seq > attempt.next_seq:
            await self._continue("gap")
            return None
        attempt.next_seq += 1
        attempt.last_chunk_at = time.monotonic()
        self._taken = True
        tokens = self._accept(chunk)
        if chunk.engine_s is not None:
            self.engine_s = (self.engine_s or 0.0) + chunk.engine_s
        match chunk.finish_reason:
            case FinishReason.STOP | FinishReason.LENGTH:
                self.finish_reason = chunk.finish_reason
                self._timed_end = chunk.engine_s is not None
            case FinishReason.ERROR:
                self.finish_reason = FinishReason.ERROR
                raise GenerationFailedError(
                    f"rollout worker {chunk.worker_id} failed: {chunk.error or 'no reason given'}"
                )
            case FinishReason.ABORT:
                await self._continue("abort")
        return tokens

    def _accept(self, chunk: TokensGenerated) -> Tokens | None:
        if not chunk.token_ids:
            return None
        self.output_ids += chunk.token_ids
        self.output_logprobs += chunk.logprobs
        self.output_versions += [chunk.version] * len(chunk.token_ids)
        return Tokens(list(chunk.token_ids), list(chunk.logprobs))

    async def _next_message(self, attempt: _Attempt) -> Msg | None:
        """The next message on ``gen.out``; None when the attempt stalled or was lost. Raises
        when no worker started the attempt in time or the connection stays down."""
        down_since: float | None = None
        while True:
            now = time.monotonic()
            if attempt.last_chunk_at is None:
                if await self._lost(attempt, now):
                    return None
                deadline = attempt.started_at + self.limits.queue_timeout_s
            else:
                deadline = attempt.last_chunk_at + self.limits.stall_timeout_s
            if now >= deadline:
                if attempt.last_chunk_at is None:
                    raise GenerationUnavailableError(
                        f"no rollout worker took the request within "
                        f"{self.limits.queue_timeout_s:g}s"
                    )
                return None
            try:  # a timeout scope, not wait_for: no task per message
                async with asyncio.timeout(min(_POLL_S, deadline - now)):
                    return await self._queue.get()
            except TimeoutError:
                pass
            if self.nc.is_connected:
                down_since = None
            elif down_since is None:
                down_since = time.monotonic()
            elif time.monotonic() - down_since >= self.limits.nats_timeout_s:
                raise GenerationUnavailableError(
                    f"lost the connection to NATS for over {self.limits.nats_timeout_s:g}s"
                )

    async def _lost(self, attempt: _Attempt, now: float) -> bool:
        """Whether the attempt's request left the gen queue with no chunk of it arriving: a
        worker took it, finished and acked it while cut off from this gateway, and its chunks
        (core NATS) were lost; nothing would redeliver it. Looked for every ``stall_timeout_s``
        until the first chunk, and lost only when found gone ``_GONE_LOOKS`` times in a row, so
        that the chunks of a request acked just now have time to arrive."""
        since = now - max(attempt.started_at, attempt.checked_at)
        if since < self.limits.stall_timeout_s or not self.nc.is_connected:
            return False
        attempt.checked_at = now
        try:
            await self.js.get_msg(self.names.gen_stream, attempt.stream_seq)
        except NotFoundError:
            attempt.gone += 1
        except (NatsError, OSError):
            pass  # cannot tell now: the connection's own checks handle an outage
        else:
            attempt.gone = 0
        return attempt.gone >= _GONE_LOOKS

    # -- attempts -------------------------------------------------------------------------

    async def _continue(self, reason: str) -> None:
        """Give up the current attempt and publish the next one from the tokens so far."""
        attempt = self._attempt
        assert attempt is not None
        self.continuations += 1
        CONTINUATIONS.labels(reason).inc()
        log.info(
            kv(
                "gateway_call_continued",
                call=self.call_id,
                attempt=attempt.number,
                reason=reason,
                tokens=len(self.output_ids),
            )
        )
        await self._cancel_attempt(f"continued: {reason}")
        self._attempt = None  # cancelled: ``close`` has nothing left to cancel
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.output_ids and self.output_ids[-1] in self.params.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif attempt.number + 1 >= self.limits.max_attempts:
            raise GenerationUnavailableError(
                f"call interrupted {self.limits.max_attempts} times (last: {reason}); giving up"
            )
        else:
            await self._publish_attempt(attempt.number + 1)

    async def _publish_attempt(self, number: int) -> None:
        done = len(self.output_ids)
        request = GenerationRequested(
            call_id=self.call_id,
            session_id=self.session_id,
            attempt=number,
            model=self.model,
            prompt_ids=self.prompt_ids + self.output_ids,
            params=self.params.model_copy(update={"max_tokens": self.params.max_tokens - done}),
            reply_to=self.names.gen_out(self.call_id),
            resumed_tokens=done,
            streamed=self.streamed,
        )
        payload, headers = codec.encode(request), codec.headers(msg_id=f"{self.call_id}-{number}")

        async def publish() -> PubAck:
            _check_connected(self.nc)  # not transient: a broker gone is 503 at once
            return await self.js.publish(self.names.gen_req, payload, headers=headers)

        # A connected broker slow to answer (JetStream under load) is asked again, with the
        # same Nats-Msg-Id (stored once), for as long as an attempt may wait in the queue.
        try:
            ack = await retry(publish, what="gen_request", give_up_s=self.limits.queue_timeout_s)
        except (NatsError, OSError, RetryStoppedError) as exc:
            raise GenerationUnavailableError(
                f"cannot queue the generation request on {self.names.gen_req}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._attempt = _Attempt(number=number, stream_seq=ack.seq, started_at=time.monotonic())

    async def _cancel_attempt(self, reason: str) -> None:
        """Tell the worker holding the attempt to stop, and take the request off the queue if no
        worker has it yet (so JetStream does not deliver it again)."""
        attempt = self._attempt
        assert attempt is not None
        if not self.nc.is_connected:
            return  # the broker is unreachable: waiting for it here would delay the error
        cancel = GenerationCancelled(call_id=self.call_id, attempt=attempt.number, reason=reason)
        await _quietly(self.nc.publish(self.names.gen_cancel(self.call_id), codec.encode(cancel)))
        await _quietly(self.js.delete_msg(self.names.gen_stream, attempt.stream_seq))

    async def _record(self) -> None:
        assert self.finish_reason is not None
        finished_at = time.time()
        record = CallRecorded(
            session_id=self.session_id,
            call_id=self.call_id,
            model=self.model,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            output_logprobs=self.output_logprobs,
            output_versions=self.output_versions,
            finish_reason=self.finish_reason,
            started_at=self._started_at,
            finished_at=finished_at,
            interruptions=self.continuations + _version_changes(self.output_versions),
            engine_s=self.engine_s,
        )
        CALL_SECONDS.labels(self.finish_reason.value).observe(finished_at - self._started_at)
        if self._timed_end:
            OVERHEAD_SECONDS.observe(max(0.0, record.added_s))
        payload, headers = codec.encode(record), codec.headers(msg_id=self.call_id)
        subject = self.names.traj_calls(self.session_id)
        for attempt in range(RECORD_ATTEMPTS):
            if attempt:
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            try:
                await self.js.publish(subject, payload, headers=headers)
                return
            except (NatsError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    kv("gateway_record_retry", call=self.call_id, attempt=attempt, error=error)
                )
        # Fail the call rather than hand out a response whose tokens the trainer never sees.
        raise RecordUnavailableError(
            f"the call record could not be stored on {subject} ({error}); "
            "the response is withheld so that no trajectory is lost"
        )


def _version_changes(versions: list[int]) -> int:
    return sum(1 for a, b in pairwise(versions) if a != b)


def _check_connected(nc: NATS) -> None:
    if not nc.is_connected:
        raise GenerationUnavailableError("not connected to NATS (the broker is unreachable)")


async def _quietly(operation) -> None:
    """Best effort: a cancel or unsubscribe that fails (broker gone, message already taken) is
    not an error of the call."""
    try:
        await operation
    except (NatsError, NotFoundError, OSError) as exc:
        log.debug(kv("gateway_best_effort_failed", error=f"{type(exc).__name__}: {exc}"))
