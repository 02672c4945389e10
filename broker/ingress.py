"""Validated ingress: a durable pull consumer whose handler only ever sees valid messages.

Each message gets exactly one outcome:

- valid, handler returns        -> ``ack``, confirmed by the server (``ack_sync``) and tried
                                   again across a broker restart: a lost ack would redo the work
- invalid (bytes, types, size)  -> published to ``sf.<run>.dead.<source>`` as a
                                   ``MessageRejected`` with the reason, then ``term``
- handler raises                -> ``nak`` with a delay: retried; on the consumer's last
                                   delivery it is dead-lettered and terminated instead
- handler raises ``HandBack``    -> ``nak`` at once, counted ``returned``: the process is
                                   stopping and another consumer should take the message
- handler raises ``UnavailableError`` (or a NATS connection error): a part the work needs is
  down, which is no fault of the message. The message is held (kept in progress, its delivery
  not spent), the ingress pauses (fetches nothing), and the handler is called again on it after
  an exponential, capped backoff; the first call that does not find a part unavailable resumes
  the ingress. A pause is one ``ingress_paused`` line and ``sf_ingress_paused{source} 1``; the
  resume one ``ingress_resumed`` line. A broker connection that drops pauses the ingress the
  same way until the client has reconnected. Stopping while paused hands the held messages back.

While a handler runs, the ingress keeps its message in progress (``in_progress`` every third of
the consumer's ``ack_wait``), so ``ack_wait`` can be short (the messages of a consumer that dies
come back within seconds) however long the work takes; handlers need not signal progress.

The loop never stops on bad input, and a message is terminated only once its dead letter is
stored, so nothing is lost. With ``concurrency`` above 1, that many messages are handled at once,
each in its own task, and the loop fetches only as many as there are free slots, so long handlers
(a generation) never leave fetched messages waiting while their ack timers run. ``room`` bounds
a fetch further (a rollout worker's: what its engine would start now; read once the handlers of
what came have run to their first ``await``); ``wake`` says it grew.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from broker import codec
from broker.config import StreamLimits
from broker.exceptions import InvalidMessageError, RetryStoppedError, UnavailableError
from broker.messages import HEADER_MAX, REASON_MAX, Message, MessageRejected, TaskSubmitted
from broker.metrics import INGRESS_MESSAGES, INGRESS_PAUSED
from broker.retry import BACKOFF, TRANSIENT, Backoff, retry
from broker.subjects import Durable, RunNames
from common.log import kv

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

DEAD_LETTER_KEEP = 64 * 1024
"""Bytes of a rejected payload kept in its dead letter."""

ACK_CONFIRM_S = 2.0
"""How long one try of a confirmed ack waits for the server's answer before trying again."""


@dataclass(frozen=True)
class Delivery:
    """Where a message came from, and a way to keep it from being redelivered while working."""

    subject: str
    stream_seq: int
    num_delivered: int
    published_at: float
    """When JetStream stored the message (Unix seconds)."""
    _msg: Msg
    retry: int = 0
    """Calls of the handler on this delivery before this one, each of which found a part it
    needs unavailable (the message was held, not redelivered)."""
    ack_wait: float = 30.0
    """The consumer's ack_wait (seconds): kept short, so that the messages of a consumer that
    dies come back soon; the ingress keeps a message in progress while its handler runs."""

    @property
    def keepalive_s(self) -> float:
        """How often the message is kept in progress: a third of ``ack_wait``, so one lost signal
        does not let the timer run out."""
        return self.ack_wait / 3

    async def in_progress(self) -> None:
        """Reset the ack timer now. The ingress does it every ``keepalive_s`` while the handler
        runs; a handler may add signals of its own (a worker's per-token keepalive)."""
        await self._msg.in_progress()


Handler = Callable[[M, Delivery], Awaitable[None]]


class HandBack(Exception):
    """Raised by a handler to give its message back unprocessed (e.g. the process is stopping):
    it is redelivered at once, to any consumer, and not counted as a failure."""


class Ingress(Generic[M]):
    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        *,
        source: str,
        stream: str,
        durable: str,
        schema: type[M],
        handler: Handler[M],
        max_payload: int,
        batch: int = 32,
        concurrency: int = 1,
        room: Callable[[], int] | None = None,
        fetch_timeout: float = 1.0,
        retry_delay: float = 5.0,
        backoff: Backoff = BACKOFF,
    ) -> None:
        self._js = js
        self._dead_subject = names.dead(source)
        self.source = source
        self._stream = stream
        self._durable = durable
        self._schema = schema
        self._handler = handler
        self._max_payload = max_payload
        self._batch = batch
        self._concurrency = concurrency
        self._handler_room = room
        self._woken = asyncio.Event()
        self._running: set[asyncio.Task] = set()
        self._fetch_timeout = fetch_timeout
        self._retry_delay = retry_delay
        self._backoff = backoff
        self._nc = js._nc  # the connection the context uses: is the broker reachable now?
        self._max_deliver = 0  # read from the consumer when the loop starts; <= 0: unlimited
        self._ack_wait = 30.0  # likewise (seconds)
        self._stop = asyncio.Event()
        self._unsettled: dict[str, Msg] = {}  # by ack subject: fetched, not yet settled
        self._paused_since: float | None = None  # time.monotonic() of the pause; None: running
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._broker_down = False
        self._keeping: asyncio.Task | None = None  # keeps unsettled messages in progress

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; returns after the current batch is settled."""
        self._stop = stop
        sub = await self._js.pull_subscribe_bind(self._durable, self._stream)
        try:  # JetStream may be electing leaders (a server's node cut off): wait for it
            info = await retry(sub.consumer_info, what=f"{self.source}_consumer_info", stop=stop)
        except RetryStoppedError:
            return
        consumer = info.config
        self._max_deliver = consumer.max_deliver or 0
        self._ack_wait = consumer.ack_wait or self._ack_wait
        INGRESS_PAUSED.labels(self.source).set(0)
        log.info(
            kv("ingress_started", source=self.source, stream=self._stream, durable=self._durable)
        )
        try:
            down = 0  # checks in a row that found the broker disconnected
            while not stop.is_set():
                # 1. Take no work while the broker or a part the handler needs is down.
                if not self._broker_reachable():
                    down += 1
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._backoff.delay(down)):
                            await stop.wait()
                    continue
                down = 0
                if self._paused_since is not None:
                    await _wait_any(stop, self._resumed)
                    continue
                # 2. Fetch what there is room for; a timeout only means nothing yet.
                self._woken.clear()
                room = self._room()
                if room == 0:
                    woken = asyncio.ensure_future(self._woken.wait())
                    await asyncio.wait({woken, *self._running}, return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()
                    continue
                msgs = await self._fetch(sub, room)
                self._unsettled.update((msg.reply, msg) for msg in msgs)
                # 3. Settle each message with exactly one outcome.
                for msg in msgs:
                    if self._concurrency == 1:
                        await self._settle_logged(msg)
                    else:
                        task = asyncio.create_task(self._settle_logged(msg))
                        self._running.add(task)
                        task.add_done_callback(self._running.discard)
                if msgs and self._handler_room is not None:
                    await asyncio.sleep(0)  # the handlers take their room before it is read again
            # 4. Let the messages in hand finish.
            if self._running:
                await asyncio.wait(self._running)
        finally:
            self._unpause()
            try:
                await sub.unsubscribe()
            except NatsError as exc:  # the broker is away: the server drops the pull anyway
                log.info(kv("ingress_unsubscribe_failed", source=self.source, error=exc))
            log.info(kv("ingress_stopped", source=self.source))

    # -- pausing ----------------------------------------------------------------------------
    def _broker_reachable(self) -> bool:
        """Whether the connection is up; pauses the ingress when it went down, resumes it when it
        came back (the client reconnects by itself)."""
        if self._nc.is_connected:
            if self._broker_down:
                self._broker_down = False
                self._resume()
            return True
        self._broker_down = True
        # Also when a held message's handler resumed the ingress meanwhile: still down.
        self._pause("broker disconnected: the client is reconnecting")
        return False

    def _pause(self, reason: str) -> None:
        if self._paused_since is not None:
            return
        self._paused_since = time.monotonic()
        self._resumed.clear()
        INGRESS_PAUSED.labels(self.source).set(1)
        self._keeping = asyncio.create_task(self._keep_unsettled())
        log.warning(kv("ingress_paused", source=self.source, reason=reason))

    def _resume(self) -> None:
        if self._paused_since is None:
            return
        after = time.monotonic() - self._paused_since
        self._unpause()
        log.info(kv("ingress_resumed", source=self.source, after_s=round(after, 1)))

    def _unpause(self) -> None:
        self._paused_since = None
        self._resumed.set()
        INGRESS_PAUSED.labels(self.source).set(0)
        if self._keeping is not None:
            self._keeping.cancel()
            self._keeping = None

    async def _keep_unsettled(self) -> None:
        """While paused, keep every message in hand from being redelivered (a held one, and the
        rest of a batch waiting behind it). Errors are the outage itself: already logged."""
        while True:  # at once first: a message may have waited most of its ack_wait already
            for msg in list(self._unsettled.values()):
                with contextlib.suppress(NatsError):
                    await msg.in_progress()
            await asyncio.sleep(max(0.1, self._ack_wait / 3))

    async def _held(self, exc: Exception, retry: int) -> bool:
        """Pause for ``exc`` (a part is unavailable) and wait before the ``retry``-th call of the
        handler on a held message: True to call it again, False when stopping."""
        self._pause(f"{type(exc).__name__}: {exc}")
        delay = self._backoff.delay(retry)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await _wait_any(self._stop, self._resumed)
        return not self._stop.is_set()

    def wake(self) -> None:
        """Say that ``room`` may have grown: a loop waiting for room looks again."""
        self._woken.set()

    def _room(self) -> int:
        if self._concurrency == 1:
            return self._batch
        # A fetch can return more than asked (messages of an earlier, expired pull request),
        # so more than ``concurrency`` may be running: then there is no room at all.
        room = max(0, min(self._batch, self._concurrency - len(self._running)))
        if self._handler_room is not None:
            room = min(room, max(0, self._handler_room()))
        # Idle: wait for one. A fetch of several ends only with the server's "no more" after
        # what it delivered (0.15-0.2 ms later here); the rest of a burst comes with the next
        # fetch, at once.
        return min(room, 1) if not self._running else room

    async def _settle_logged(self, msg: Msg) -> None:
        try:
            await self._settle(msg)
        except (NatsError, RetryStoppedError) as exc:
            # The broker went away mid-settle: JetStream redelivers after ack_wait.
            log.warning(kv("ingress_settle_failed", source=self.source, error=exc))
        finally:
            self._unsettled.pop(msg.reply, None)

    async def _fetch(self, sub: JetStreamContext.PullSubscription, count: int) -> list[Msg]:
        try:
            return await sub.fetch(count, timeout=self._fetch_timeout)
        except (NatsTimeoutError, TimeoutError):
            return []
        except NatsError as exc:  # e.g. disconnected: the client reconnects by itself
            log.warning(kv("ingress_fetch_failed", source=self.source, error=exc))
            await asyncio.sleep(self._fetch_timeout)
            return []

    async def _settle(self, msg: Msg) -> None:
        meta = msg.metadata
        content_type = codec.content_type_of(msg.headers)
        try:
            message = codec.decode(
                self._schema, msg.data, content_type=content_type, max_size=self._max_payload
            )
        except InvalidMessageError as exc:
            await self._reject(msg, exc.reason, content_type)
            return
        except Exception as exc:  # a decoder bug must not stop the loop: the message is the cause
            await self._reject(msg, f"cannot decode: {type(exc).__name__}: {exc}", content_type)
            return
        seq, stored_at = meta.sequence.stream, meta.timestamp.timestamp()
        delivery = Delivery(
            msg.subject, seq, meta.num_delivered, stored_at, msg, ack_wait=self._ack_wait
        )
        while True:
            called = time.monotonic()
            try:
                await self._handled(message, delivery)
            except (UnavailableError, *TRANSIENT) as exc:
                # Not the message's fault: hold it (its delivery not spent) and call again.
                retry = delivery.retry + 1
                if await self._held(exc, retry):
                    delivery = dataclasses.replace(delivery, retry=retry)
                    continue
                await self._hand_back(msg, f"stopping while paused: {type(exc).__name__}")
                return
            except Exception as exc:
                self._answered(called)
                await self._settle_raised(msg, exc, content_type)
                return
            self._answered(called)
            await self._ack(msg)
            INGRESS_MESSAGES.labels(self.source, "accepted").inc()
            return

    async def _handled(self, message: M, delivery: Delivery) -> None:
        """Call the handler, keeping its message in progress until it returns or raises."""
        keeping = asyncio.create_task(self._keep_in_progress(delivery))
        try:
            await self._handler(message, delivery)
        finally:
            keeping.cancel()

    async def _keep_in_progress(self, delivery: Delivery) -> None:
        while True:
            await asyncio.sleep(delivery.keepalive_s)
            try:
                await delivery.in_progress()
            except NatsError as exc:  # an outage: the ingress pauses and keeps it in progress
                log.debug(kv("in_progress_failed", source=self.source, error=exc))

    async def _ack(self, msg: Msg) -> None:
        """Ack, and wait for the server to confirm it, trying again across a broker restart: an
        ack lost on the way would have the message redelivered after ack_wait, its work done
        twice. Stopping ends the tries (the message then comes back, as with any lost ack)."""
        await retry(
            lambda: msg.ack_sync(timeout=ACK_CONFIRM_S), what=f"{self.source}_ack", stop=self._stop
        )

    def _answered(self, called: float) -> None:
        """A handler call made since the pause found every part it needs: resume."""
        if self._paused_since is not None and called >= self._paused_since:
            self._resume()

    async def _settle_raised(self, msg: Msg, exc: Exception, content_type: str | None) -> None:
        meta = msg.metadata
        if isinstance(exc, InvalidMessageError):
            await self._reject(msg, exc.reason, content_type)
            return
        if isinstance(exc, HandBack):
            await self._hand_back(msg, str(exc))
            return
        error = f"{type(exc).__name__}: {exc}"
        INGRESS_MESSAGES.labels(self.source, "failed").inc()
        log.error(
            kv(
                "ingress_handler_failed",
                source=self.source,
                seq=meta.sequence.stream,
                delivered=meta.num_delivered,
                error=error,
            ),
            exc_info=exc,
        )
        if 0 < self._max_deliver <= meta.num_delivered:
            reason = f"handler failed on all {meta.num_delivered} deliveries; last: {error}"
            await self._reject(msg, reason, content_type)
        else:
            await msg.nak(delay=self._retry_delay)

    async def _hand_back(self, msg: Msg, why: str) -> None:
        await msg.nak()
        INGRESS_MESSAGES.labels(self.source, "returned").inc()
        seq = msg.metadata.sequence.stream
        log.info(kv("ingress_handed_back", source=self.source, seq=seq, why=why))

    async def _reject(self, msg: Msg, reason: str, content_type: str | None) -> None:
        seq = msg.metadata.sequence.stream
        try:
            await dead_letter(
                self._js,
                self._dead_subject,
                source=self.source,
                stream=self._stream,
                stream_seq=seq,
                subject=msg.subject,
                payload=msg.data,
                content_type=content_type,
                reason=reason,
            )
        except NatsError as exc:
            # Keep the message rather than lose it: it comes back after the delay.
            log.error(kv("dead_letter_failed", source=self.source, seq=seq, error=exc))
            await msg.nak(delay=self._retry_delay)
            return
        await msg.term()
        INGRESS_MESSAGES.labels(self.source, "rejected").inc()
        log.warning(
            kv(
                "message_rejected",
                source=self.source,
                subject=msg.subject,
                seq=seq,
                dead_letter=self._dead_subject,
                reason=reason,
            )
        )


async def dead_letter(
    js: JetStreamContext,
    dead_subject: str,
    *,
    source: str,
    stream: str,
    stream_seq: int,
    subject: str,
    payload: bytes,
    content_type: str | None,
    reason: str,
) -> None:
    """Store a ``MessageRejected`` for message ``stream_seq`` of ``stream`` on ``dead_subject``,
    de-duplicated by ``<stream>-<stream_seq>``; raises the NATS error when it is not stored."""
    rejected = MessageRejected(
        source=source,
        subject=subject,
        reason=reason[:REASON_MAX],
        payload=payload[:DEAD_LETTER_KEEP],
        payload_size=len(payload),
        content_type=(content_type or "")[:HEADER_MAX],
        stream_seq=stream_seq,
        rejected_at=time.time(),
    )
    await js.publish(
        dead_subject,
        codec.encode(rejected),
        headers=codec.headers(msg_id=f"{stream}-{stream_seq}"),
    )


async def _wait_any(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def tasks_ingress(
    js: JetStreamContext,
    names: RunNames,
    handler: Handler[TaskSubmitted],
    limits: StreamLimits,
    *,
    durable: Durable,
    **options: float | Backoff,
) -> Ingress[TaskSubmitted]:
    """The validated ingress of a run's task stream, sized by the run's ``tasks`` limits: client
    tasks (durable ``scheduler``) or admitted ones (durable ``agents``); a bad task is
    dead-lettered as ``tasks`` either way. ``options``: ``batch``, ``concurrency``,
    ``fetch_timeout``, ``retry_delay``, ``backoff`` (a ``broker.retry.Backoff``)."""
    return Ingress(
        js,
        names,
        source="tasks",
        stream=names.tasks_stream,
        durable=durable,
        schema=TaskSubmitted,
        handler=handler,
        max_payload=limits.max_payload,
        **options,
    )
