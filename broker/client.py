"""Connecting to NATS: callbacks wired to logs, errors translated at the boundary."""

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from broker.auth import IDENTITIES_ENV, IDENTITY_ENV, Identity, identity_path
from broker.exceptions import (
    AuthorizationError,
    BrokerError,
    BrokerTlsError,
    BrokerUnavailableError,
    StoppedWaitingError,
)
from broker.metrics import NATS_RETRIES, REFUSED
from broker.permissions import Principal
from broker.tls import CA_ENV, client_context
from common.log import kv

log = logging.getLogger(__name__)
FIRST = asyncio.FIRST_COMPLETED


PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 2
"""A server that stops answering (its node cut off: no FIN, no RST) is left for another of the
cluster after about (``MAX_OUTSTANDING_PINGS`` + 1) * ``PING_INTERVAL_S``; nats.py's defaults
(120 s, 2) kept a client on a cut-off server for up to 6 minutes."""

WAIT_LOG_S = 30.0
"""How often a service waiting for its broker at start says it still waits."""
ROUND_TRIP_LIMIT_S = 4 * PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1)
"""``round_trip``'s flush: well after nats-py found the connection stale and made it again
(which drops the pongs awaited, so a flush timing out then leaves nothing behind)."""
ROUND_TRIP_WAIT_S = 5.0
"""How long ``round_trip`` waits by default (the gateway's ``CallUnavailable`` before its 503,
the agent runner's check after a failed attempt): a broker slower than that is going away."""


async def connect(
    url: str,
    name: str,
    *,
    give_up_after: float = 5.0,
    stop: asyncio.Event | None = None,
    principal: Principal | None = None,
    identity_file: Path | None = None,
    ca_file: Path | None = None,
) -> NATS:
    """Connect to ``url`` as client ``name`` within ``give_up_after`` seconds; once connected, the
    client reconnects forever. ``url`` may list several servers of a cluster, comma-separated
    (``nats://a:4222,nats://b:4222``): the client connects to any and moves to another when its
    server goes away (it also learns the cluster's other servers from the one it reaches).

    With ``stop`` (a long-running service): wait for the broker as long as it takes, as the
    service would once connected (it was started first, or the broker is restarting), saying so
    every ``WAIT_LOG_S``, until ``stop`` is set, which raises ``StoppedWaitingError``.

    It connects as ``identity_file``, else the file named by ``$SEAMLESSFLOW_NATS_IDENTITY``,
    else ``principal``'s file in ``$SEAMLESSFLOW_NATS_IDENTITIES`` (``broker.auth``), else
    anonymously, which only a broker started ``--insecure`` lets in. A
    refused identity raises ``AuthorizationError`` at once: waiting would not change the
    answer. With ``ca_file``, else ``$SEAMLESSFLOW_NATS_CA``, it speaks TLS and trusts only that
    CA; a server it cannot verify raises ``BrokerTlsError`` at once (fails closed)."""
    identity_file = identity_path(identity_file, principal)
    identity = Identity.load(identity_file) if identity_file else None
    if identity is not None and identity.expired():
        REFUSED.labels("expired").inc()
        raise AuthorizationError(
            f"identity {identity_file} (run {identity.run}, {identity.principal}) expired at "
            f"{identity.expires:%Y-%m-%d %H:%M:%S %Z}: the broker refuses it; issue a new one "
            f"with `seamlessflow creds --run {identity.run} --principal {identity.principal} "
            "--valid-for DURATION`"
        )
    ca = ca_file or (Path(os.environ[CA_ENV]) if os.environ.get(CA_ENV) else None)
    options = identity.connect_options() if identity else {}
    if ca:
        options["tls"] = client_context(ca, identity.cert if identity else None)
    refused: asyncio.Future[BrokerError] = asyncio.get_running_loop().create_future()
    up = False
    attempts = 0

    async def error_cb(exc: Exception) -> None:
        nonlocal attempts
        if not up and isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError):
            attempts += 1  # not there yet: one line, not one per attempt (2 a second)
            NATS_RETRIES.labels("connect").inc()
            if attempts == 1:
                log.warning(kv("nats_waiting", client=name, url=url, error=_error(exc)))
            return
        text = str(exc).lower()
        fatal: BrokerError | None = None
        if "authorization violation" in text:
            REFUSED.labels("authorization").inc()
            fatal = _refused(url, identity_file, identity)
        elif isinstance(exc, ssl.SSLError):
            REFUSED.labels("tls").inc()
            fatal = BrokerTlsError(
                f"TLS with NATS at {url} failed ({exc}); the broker's CA is given by "
                f"${CA_ENV} (now {ca or 'unset'})"
            )
        elif "permissions violation" in text:
            REFUSED.labels("permissions").inc()
        if fatal is not None and not refused.done():  # the first refusal is the answer
            refused.set_result(fatal)
        log.warning(kv("nats_error", client=name, error=_error(exc)))

    async def disconnected_cb() -> None:
        log.info(kv("nats_disconnected", client=name, url=url))

    async def reconnected_cb() -> None:
        log.info(kv("nats_reconnected", client=name, url=url))

    async def closed_cb() -> None:
        log.info(kv("nats_closed", client=name))

    nc = NATS()
    connecting = asyncio.ensure_future(
        nc.connect(
            [server.strip() for server in url.split(",") if server.strip()],
            name=name,
            connect_timeout=min(give_up_after, 2.0),
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            closed_cb=closed_cb,
            **options,
        )
    )
    stopping = asyncio.ensure_future(stop.wait() if stop else asyncio.Future())
    started = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait(
                {connecting, refused, stopping},
                timeout=give_up_after if stop is None else WAIT_LOG_S,
                return_when=FIRST,
            )
            if done or stop is None:
                break
            waited = round(time.monotonic() - started)
            log.warning(kv("nats_waiting", client=name, url=url, waited_s=waited))
    finally:
        stopping.cancel()
    if not connecting.done() or refused.done():
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, NatsError, OSError):
            await connecting
        await nc.close()
        if refused.done():
            raise refused.result()
        if stop is not None and stop.is_set():
            raise StoppedWaitingError(f"stopped while waiting for NATS at {url}")
        raise _unavailable(url, give_up_after, TimeoutError("no answer"))
    try:
        connecting.result()
    except (NatsError, OSError) as exc:
        await nc.close()
        raise _unavailable(url, give_up_after, exc) from exc
    up = True
    if attempts:
        after = round(time.monotonic() - started, 1)
        log.info(kv("nats_connected", client=name, url=url, tries=attempts + 1, after_s=after))
    return nc


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _refused(url: str, path: Path | None, identity: Identity | None) -> AuthorizationError:
    who = (
        f"identity {path} (run {identity.run}, {identity.principal})"
        if identity
        else f"no identity (${IDENTITY_ENV} and ${IDENTITIES_ENV} are unset)"
    )
    return AuthorizationError(
        f"NATS at {url} refused {who}: it is unknown there, of another run, or the broker wants "
        "one; issue one with `seamlessflow creds`"
    )


def _unavailable(url: str, give_up_after: float, exc: BaseException) -> BrokerUnavailableError:
    return BrokerUnavailableError(
        f"cannot reach NATS at {url} within {give_up_after:g}s ({_error(exc)}); "
        "start one with `seamlessflow broker` or pass --nats URL / SEAMLESSFLOW_NATS_URL"
    )


async def disconnect(nc: NATS, *, drain_within: float = 10.0) -> None:
    """Drain (pending publishes go out first) when connected; just close when the broker is gone
    or the drain takes longer than ``drain_within`` seconds, as draining would wait for it."""
    if nc.is_connected:
        with contextlib.suppress(NatsError, TimeoutError):
            await asyncio.wait_for(nc.drain(), drain_within)
            return
    try:
        await nc.close()
    except OSError as exc:  # nats-py flushes what is pending onto the dead socket
        log.info(kv("nats_close_failed", error=f"{type(exc).__name__}: {exc}"))


async def round_trip(nc: NATS, within_s: float = ROUND_TRIP_WAIT_S) -> bool:
    """A PING/PONG with the server, waited for up to ``within_s``: True once all this connection
    sent before is at the server, and all the server sent it before has been read. Not nats-py's
    ``flush(timeout)`` alone: one that times out leaves its cancelled future among the pongs
    awaited, and the late PONG then ends the connection's read loop (``InvalidStateError``).
    Here the flush goes on waiting, in the background, for as long as a PONG may take."""
    flushed = asyncio.ensure_future(nc.flush(timeout=ROUND_TRIP_LIMIT_S))
    flushed.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
    await asyncio.wait({flushed}, timeout=within_s)
    return flushed.done() and not flushed.cancelled() and flushed.exception() is None


@asynccontextmanager
async def session(
    url: str,
    name: str,
    *,
    give_up_after: float = 5.0,
    stop: asyncio.Event | None = None,
    principal: Principal | None = None,
    identity_file: Path | None = None,
    ca_file: Path | None = None,
) -> AsyncIterator[NATS]:
    """``connect`` for the duration of a block, then ``disconnect``."""
    nc = await connect(
        url,
        name,
        give_up_after=give_up_after,
        stop=stop,
        principal=principal,
        identity_file=identity_file,
        ca_file=ca_file,
    )
    try:
        yield nc
    finally:
        await disconnect(nc)
