"""Validated ingress: a durable pull consumer whose handler only ever sees valid messages.

Each message gets exactly one outcome:

- valid, handler returns        -> ``ack``
- invalid (bytes, types, size)  -> published to ``sf.<run>.dead.<source>`` as a
                                   ``MessageRejected`` with the reason, then ``term``
- handler raises                -> ``nak`` with a delay: retried; on the consumer's last
                                   delivery it is dead-lettered and terminated instead
- handler raises ``HandBack``    -> ``nak`` at once, counted ``returned``: the process is
                                   stopping and another consumer should take the message

The loop never stops on bad input, and a message is terminated only once its dead letter is
stored, so nothing is lost. With ``concurrency`` above 1, that many messages are handled at once,
each in its own task, and the loop fetches only as many as there are free slots, so long handlers
(a generation) never leave fetched messages waiting while their ack timers run.
"""

import asyncio
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
from broker.exceptions import InvalidMessageError
from broker.messages import HEADER_MAX, REASON_MAX, Message, MessageRejected, TaskSubmitted
from broker.metrics import INGRESS_MESSAGES
from broker.subjects import Durable, RunNames
from common.log import kv

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

DEAD_LETTER_KEEP = 64 * 1024
"""Bytes of a rejected payload kept in its dead letter."""


@dataclass(frozen=True)
class Delivery:
    """Where a message came from, and a way to keep it from being redelivered while working."""

    subject: str
    stream_seq: int
    num_delivered: int
    published_at: float
    """When JetStream stored the message (Unix seconds)."""
    _msg: Msg

    async def in_progress(self) -> None:
        """Reset the ack timer: call it more often than the consumer's ack_wait."""
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
        fetch_timeout: float = 1.0,
        retry_delay: float = 5.0,
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
        self._running: set[asyncio.Task] = set()
        self._fetch_timeout = fetch_timeout
        self._retry_delay = retry_delay
        self._max_deliver = 0  # read from the consumer when the loop starts; <= 0: unlimited

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; returns after the current batch is settled."""
        sub = await self._js.pull_subscribe_bind(self._durable, self._stream)
        self._max_deliver = (await sub.consumer_info()).config.max_deliver or 0
        log.info(
            kv("ingress_started", source=self.source, stream=self._stream, durable=self._durable)
        )
        try:
            while not stop.is_set():
                # 1. Fetch what there is room for; a timeout only means nothing yet.
                room = self._room()
                if room == 0:
                    await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                msgs = await self._fetch(sub, room)
                # 2. Settle each message with exactly one outcome.
                for msg in msgs:
                    if self._concurrency == 1:
                        await self._settle_logged(msg)
                    else:
                        task = asyncio.create_task(self._settle_logged(msg))
                        self._running.add(task)
                        task.add_done_callback(self._running.discard)
            # 3. Let the messages in hand finish.
            if self._running:
                await asyncio.wait(self._running)
        finally:
            await sub.unsubscribe()
            log.info(kv("ingress_stopped", source=self.source))

    def _room(self) -> int:
        if self._concurrency == 1:
            return self._batch
        # A fetch can return more than asked (messages of an earlier, expired pull request),
        # so more than ``concurrency`` may be running: then there is no room at all.
        return max(0, min(self._batch, self._concurrency - len(self._running)))

    async def _settle_logged(self, msg: Msg) -> None:
        try:
            await self._settle(msg)
        except NatsError as exc:
            # The broker went away mid-settle: JetStream redelivers after ack_wait.
            log.warning(kv("ingress_settle_failed", source=self.source, error=exc))

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
            stored_at = meta.timestamp.timestamp()
            delivery = Delivery(
                msg.subject, meta.sequence.stream, meta.num_delivered, stored_at, msg
            )
            await self._handler(message, delivery)
        except InvalidMessageError as exc:
            await self._reject(msg, exc.reason, content_type)
            return
        except HandBack as exc:
            await msg.nak()
            INGRESS_MESSAGES.labels(self.source, "returned").inc()
            seq = meta.sequence.stream
            log.info(kv("ingress_handed_back", source=self.source, seq=seq, why=exc))
            return
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            INGRESS_MESSAGES.labels(self.source, "failed").inc()
            log.exception(
                kv(
                    "ingress_handler_failed",
                    source=self.source,
                    seq=meta.sequence.stream,
                    delivered=meta.num_delivered,
                    error=error,
                )
            )
            if 0 < self._max_deliver <= meta.num_delivered:
                reason = f"handler failed on all {meta.num_delivered} deliveries; last: {error}"
                await self._reject(msg, reason, content_type)
            else:
                await msg.nak(delay=self._retry_delay)
            return
        await msg.ack()
        INGRESS_MESSAGES.labels(self.source, "accepted").inc()

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


def tasks_ingress(
    js: JetStreamContext,
    names: RunNames,
    handler: Handler[TaskSubmitted],
    limits: StreamLimits,
    **options: float,
) -> Ingress[TaskSubmitted]:
    """The validated ingress of a run's task stream (durable ``agents``), sized by the run's
    ``tasks`` limits. ``options``: ``batch``, ``fetch_timeout``, ``retry_delay``."""
    return Ingress(
        js,
        names,
        source="tasks",
        stream=names.tasks_stream,
        durable=Durable.AGENTS,
        schema=TaskSubmitted,
        handler=handler,
        max_payload=limits.max_payload,
        **options,
    )
