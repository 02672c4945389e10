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
"""

import math
import zlib
from collections.abc import Awaitable, Callable

import httpx
import openai

TASKS_PER_POOL = 4
"""Tasks whose attempts share a connection pool, about: a pool then holds a few dozen."""


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
    ) -> None:
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

    @property
    def http(self) -> httpx.AsyncClient:
        """A plain HTTP client (``/health``)."""
        return self._pools[0]

    @property
    def first(self) -> openai.AsyncOpenAI:
        """A client for calls of no task (``/v1/models``)."""
        return self._clients[0]

    def for_task(self, task_id: str) -> openai.AsyncOpenAI:
        """The client of ``task_id``'s attempts: the same for all of them."""
        return self._clients[zlib.crc32(task_id.encode()) % len(self._clients)]

    async def aclose(self) -> None:
        for client in self._clients:
            await client.close()
