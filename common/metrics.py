"""Prometheus ``/metrics`` for every long-running process, each exporting only its own metrics.

Every part keeps its metrics in its own ``CollectorRegistry`` (never the global default one), and
a process serves the registries of the parts it runs, plus its own process/platform/GC metrics:
a trainer exports no ``sf_rollout_*`` family, a gateway no ``sf_trainer_*``.
"""

import asyncio
import logging
import os
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

import httpx
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    start_http_server,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common.log import kv

log = logging.getLogger(__name__)


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` server; ``port`` is the real one when 0 was asked for."""

    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def url(self) -> str:
        host = self.server.server_address[0]
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def process_registry(*parts: CollectorRegistry) -> CollectorRegistry:
    """One registry for a process: the given parts' registries and the process's own metrics."""
    served = CollectorRegistry(auto_describe=False)
    for collector in (*parts, PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        served.register(collector)
    return served


def serve_metrics(
    *parts: CollectorRegistry, port: int = 0, host: str | None = None
) -> MetricsEndpoint:
    """Serve ``parts`` (see ``process_registry``) on ``host:port`` (0: a free port), in a thread.
    ``host`` defaults to ``$SEAMLESSFLOW_METRICS_HOST``, else 127.0.0.1 (a pod or a cluster node
    sets 0.0.0.0 so that probes and Prometheus reach it)."""
    host = host or os.environ.get("SEAMLESSFLOW_METRICS_HOST") or "127.0.0.1"
    server, thread = start_http_server(port, addr=host, registry=process_registry(*parts))
    return MetricsEndpoint(server=server, thread=thread)


async def scrape(url: str, key: str | None = None) -> list[Sample]:
    """Every sample a ``/metrics`` endpoint serves now; ``key``: the bearer key one that checks
    keys wants (the gateway's ``metrics`` key)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(timeout=5.0) as http:
        body = (await http.get(url, headers=headers)).raise_for_status().text
    return [sample for family in text_string_to_metric_families(body) for sample in family.samples]


async def scrape_all(urls: list[str]) -> list[Sample]:
    """The samples of every ``/metrics`` endpoint of ``urls`` together, read at once; one that
    cannot be read is left out (a WARNING line)."""
    found: list[Sample] = []
    read = await asyncio.gather(*map(scrape, urls), return_exceptions=True)
    for url, samples in zip(urls, read, strict=True):
        if isinstance(samples, httpx.HTTPError):
            log.warning(kv("metrics_unreadable", url=url, error=samples))
        elif isinstance(samples, BaseException):
            raise samples
        else:
            found += samples
    return found


def metric_sum(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` that carry at least ``labels``."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def metric_mean(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The mean observation of the histogram (or summary) ``name`` over the samples that carry
    at least ``labels``; None without any."""
    count = metric_sum(samples, f"{name}_count", **labels)
    return metric_sum(samples, f"{name}_sum", **labels) / count if count else None
