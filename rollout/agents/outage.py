"""Whether an attempt that failed met the gateway's outage (``rollout.agents.runner``): no
attempt is scored against one. The SDK's errors say so themselves (503, no answer); an agent on
another client (plain httpx, a command in any language) reports the gateway's 503 its own way.
So the gateway tells the calls it could not serve (``CallUnavailable``, core NATS on
``sf.<run>.gw.unavailable.<session_id>``, before the client has the 503), and a failed attempt
is scored only if none of its session's calls was told and ``/health`` answers now."""

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CollectorRegistry, Counter

from broker import codec
from broker.client import round_trip
from broker.exceptions import InvalidMessageError
from broker.messages import CallUnavailable
from broker.subjects import RunNames
from common.log import kv
from rollout.agents.clients import GatewayClients
from rollout.agents.exceptions import GatewayUnavailableError

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics
BAD_NOTICES = Counter(
    "sf_agents_bad_unavailable_notices",
    "CallUnavailable notices that could not be read (ignored, logged)",
    registry=REGISTRY,
)


class GatewayOutage:
    """The notices of the sessions being run (``watching``), and the check of a failed one."""

    def __init__(self, nc: NATS, names: RunNames, clients: GatewayClients) -> None:
        self._nc = nc
        self._names = names
        self._clients = clients
        self._told: dict[str, str | None] = {}  # a session being run -> the gateway's reason
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        subject = self._names.gw_unavailable_all
        self._subscription = await self._nc.subscribe(subject, cb=self._on_notice)

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):  # a connection closing takes it anyway
                await self._subscription.unsubscribe()

    @contextlib.contextmanager
    def watching(self, session_ids: list[str]) -> Iterator[None]:
        """The notices of these sessions are kept while they run (others are ignored)."""
        self._told.update(dict.fromkeys(session_ids))
        try:
            yield
        finally:
            for session_id in session_ids:
                self._told.pop(session_id, None)

    async def _on_notice(self, msg: Msg) -> None:
        try:
            notice = codec.decode(CallUnavailable, msg.data)
        except InvalidMessageError as exc:
            BAD_NOTICES.inc()
            log.warning(kv("bad_unavailable_notice", subject=msg.subject, error=exc.reason))
            return
        if notice.session_id in self._told:
            self._told[notice.session_id] = notice.reason or "unavailable"

    async def check(self, session_id: str, reason: str) -> None:
        """``GatewayUnavailableError`` (the task is held) if the gateway told it could not serve
        a call of the session (every notice it sent before is in: a round trip to the server
        first), or if it does not serve now (a fresh ``/health``)."""
        await round_trip(self._nc)  # not answered: the broker is going, /health below
        await asyncio.sleep(0)  # the subscription's task hands over what the flush let in
        told = self._told.get(session_id)
        if told is not None:
            raise GatewayUnavailableError(
                f"session {session_id}: the agent failed ({reason}); the gateway could not "
                f"serve its call: {told}"
            )
        self._clients.down()
        try:
            await self._clients.serving()
        except GatewayUnavailableError as exc:
            raise GatewayUnavailableError(
                f"session {session_id}: the agent failed ({reason}) and {exc}"
            ) from exc
