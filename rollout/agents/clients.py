"""The agent runner's clients of the gateway: several HTTP connection pools, not one.

httpcore's pool (1.0.9) does work in proportion to its connections times its idle connections
on every request it sends and every response it ends: for each idle connection it counts every
connection again, and each connection's expiry check polls its socket. One pool holding a
connection for every attempt running (about 200 in ``bench/pipeline.py``'s emulated cluster) took
44% of the runner's event loop there (docs/performance.md, "The agent runner's event loop"). So
the attempts of a task share one of ``ceil(max_tasks / TASKS_PER_POOL)`` pools, chosen by its
task id; each pool has no connection limit of its own (a call never waits for a connection), and
all share one TLS context (making one costs about 40 ms). The fix belongs in httpcore
(encode/httpcore#1035, open, makes the pass linear); once a release has it, one pool will do.

Before a task's attempts the runner asks whether the gateway serves (``serving``); the answer
stands ``HEALTHY_FOR_S``, so the tasks a step's end admits at once make one ``/health`` call, not
one each, and none waits a round trip more for it.
"""

import asyncio
import math
import time
import zlib
from collections.abc import Awaitable, Callable

import httpx
import openai

from rollout.agents.exceptions import GatewayUnavailableError

TASKS_PER_POOL = 4
"""Tasks whose attempts share a connection pool, about: a pool then holds a few dozen."""
HEALTHY_FOR_S = 1.0
"""How long the gateway's ``/health`` answer stands for it serving (until a call finds it down:
``down``)."""


class GatewayClients:
    """OpenAI clients of the gateway at ``base_url``, a connection pool each."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_tasks: int,
        timeout_s: float,
        on_request: Callable[[httpx.Request], Awaitable[None]],
        model: str | None = None,
    ) -> None:
        self._base_url = base_url
        self._health_url = base_url.removesuffix("/v1") + "/health"
        self.model = model
        """The model to call: given, or the gateway's first (``/v1/models``)."""
        self._healthy_at = -math.inf
        self._check: asyncio.Task[None] | None = None
        tls = httpx.create_ssl_context()
        self._pools = [
            httpx.AsyncClient(
                verify=tls,
                timeout=timeout_s,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                event_hooks={"request": [on_request]},
            )
            for _ in range(math.ceil(max_tasks / TASKS_PER_POOL))
        ]
        self._clients = [
            openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=h)
            for h in self._pools
        ]

    async def serving(self) -> str:
        """The model to call, once the gateway says it serves (asked at most once in
        ``HEALTHY_FOR_S``, the callers meanwhile sharing the one answer); raises
        ``GatewayUnavailableError``."""
        if time.monotonic() - self._healthy_at >= HEALTHY_FOR_S:
            if self._check is None or self._check.done():
                self._check = asyncio.create_task(self._ask())
            await asyncio.shield(self._check)  # a caller cancelled leaves it to the others
        assert self.model is not None
        return self.model

    def down(self) -> None:
        """A call found the gateway down: the next ``serving`` asks again."""
        self._healthy_at = -math.inf

    async def _ask(self) -> None:
        try:
            health = await self._pools[0].get(self._health_url)
            if health.status_code != 200:
                raise GatewayUnavailableError(
                    f"gateway {self._health_url} answered {health.status_code}: {health.text[:200]}"
                )
            if self.model is None:
                self.model = (await self._clients[0].models.list()).data[0].id
        except (httpx.HTTPError, openai.APIError, IndexError) as exc:
            raise GatewayUnavailableError(
                f"gateway {self._base_url} unavailable: {type(exc).__name__}: {exc}"
            ) from exc
        self._healthy_at = time.monotonic()

    def for_task(self, task_id: str) -> openai.AsyncOpenAI:
        """The client of ``task_id``'s attempts: the same for all of them."""
        return self._clients[zlib.crc32(task_id.encode()) % len(self._clients)]

    async def aclose(self) -> None:
        for client in self._clients:
            await client.close()
