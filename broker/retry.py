"""Retrying NATS operations across a broker restart: the one helper every long-running path uses.

Once connected, a client reconnects by itself (``broker.client.connect``), so an outage is a
matter of seconds; what an operation sees meanwhile is a *transient* error: a timeout, "the
connection is reconnecting", no responders, JetStream not answering. Such an error says nothing
about the operation, so ``retry`` repeats the operation (with capped exponential backoff) until it
succeeds or the caller stops. Any other error is the operation's own and is raised at once.

Operations given to ``retry`` must be safe to repeat: a publish with a ``Nats-Msg-Id`` (JetStream
drops the copy), a confirmed ack (acking twice is harmless), a KV put, an object put by name.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from nats import errors as nats_errors
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from broker.exceptions import RetryStoppedError
from broker.metrics import NATS_RETRIES
from common.log import kv

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT = (
    nats_errors.ConnectionClosedError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.NoServersError,
    nats_errors.NoRespondersError,
    nats_errors.OutboundBufferLimitError,
    nats_errors.StaleConnectionError,
    nats_errors.TimeoutError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
"""NATS errors that mean the broker cannot serve now (reconnecting, restarting, JetStream not
answering), not that the operation is wrong."""


@dataclass(frozen=True)
class Backoff:
    """Waits between tries: ``first_s``, doubling up to ``max_s``. A broker restart takes a few
    seconds, so the cap keeps a recovered broker from waiting long for its clients."""

    first_s: float = 0.5
    max_s: float = 5.0

    def delay(self, tries: int) -> float:
        """The wait after the ``tries``-th failed try (1-based)."""
        return min(self.first_s * 2 ** (tries - 1), self.max_s)


BACKOFF = Backoff()


async def retry(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    stop: asyncio.Event | None = None,
    give_up_s: float | None = None,
    backoff: Backoff = BACKOFF,
) -> T:
    """``await operation()``, again after each transient NATS error, until it succeeds.

    The first try is always made. Once ``stop`` is set, or ``give_up_s`` have passed since the
    first try, no further try is made and ``RetryStoppedError`` (an ``UnavailableError``) is
    raised from the last error. ``what`` names
    the operation in logs and in ``sf_nats_retries_total{what}``: the first failure is one
    WARNING line, the recovery one INFO line.
    """
    tries, started = 0, time.monotonic()
    while True:
        try:
            result = await operation()
        except TRANSIENT as exc:
            tries += 1
            NATS_RETRIES.labels(what).inc()
            error = f"{type(exc).__name__}: {exc}"
            if tries == 1:
                log.warning(kv("nats_retrying", what=what, error=error))
            late = give_up_s is not None and time.monotonic() - started >= give_up_s
            if late or (stop is not None and stop.is_set()):
                raise RetryStoppedError(f"{what}: stopped while retrying ({error})") from exc
            if stop is None:
                await asyncio.sleep(backoff.delay(tries))
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff.delay(tries))
            continue
        if tries:
            after = round(time.monotonic() - started, 1)
            log.info(kv("nats_recovered", what=what, tries=tries + 1, after_s=after))
        return result
