"""The data plane's own metrics: ingress outcomes and JetStream depths."""

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.log import kv

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics


@dataclass(frozen=True)
class ConsumerStatus:
    name: str
    pending: int
    ack_pending: int
    redelivered: int


@dataclass(frozen=True)
class StreamStatus:
    name: str
    messages: int
    bytes: int
    consumers: list[ConsumerStatus]


INGRESS_MESSAGES = Counter(
    "sf_ingress_messages",
    "Messages seen at a validated ingress, by outcome: accepted (handled and acked), "
    "rejected (dead-lettered and terminated: invalid, or the handler failed on the last "
    "delivery), failed (the handler raised; counted on every failed delivery), returned "
    "(handed back unprocessed by a stopping process)",
    ["source", "outcome"],
    registry=REGISTRY,
)
INGRESS_PAUSED = Gauge(
    "sf_ingress_paused",
    "1 while a validated ingress takes no new work because a part it needs (the broker, the "
    "gateway, an engine) is unavailable; its messages in hand wait, none is failed",
    ["source"],
    registry=REGISTRY,
)
NATS_RETRIES = Counter(
    "sf_nats_retries",
    "NATS operations tried again after a transient error (the broker reconnecting or "
    "restarting), by operation (broker.retry)",
    ["what"],
    registry=REGISTRY,
)

REFUSED = Counter(
    "sf_nats_refused",
    "What the broker refused this process, by reason: authorization (its identity is unknown, "
    "of another run, or missing on a secured broker), expired (its identity expired: not "
    "tried), tls (the broker's certificate is not "
    "signed by the CA this process trusts) or permissions (a subject its role may not use: a "
    "bug or an attack; docs/security.md)",
    ["reason"],
    registry=REGISTRY,
)
SERVER_REGISTRY = CollectorRegistry()
"""The embedded broker's own (``seamlessflow broker``, and the broker of ``seamlessflow run``)."""
RUNS_REFUSED = Gauge(
    "sf_broker_runs_refused",
    "Runs with identities issued that an embedded broker does not serve (they are refused "
    "like strangers): their accounts' JetStream limits ([broker.account]) do not fit the "
    "server's JetStream storage or memory beside the runs issued before them",
    registry=SERVER_REGISTRY,
)


class StreamDepthCollector(Collector):
    """Reports the depth of every JetStream stream and durable consumer on the server, of every
    account (every run), from the server's monitoring endpoint (``/jsz``): it needs no identity.

    ``poll`` refreshes a snapshot in the background; a scrape only reads the snapshot, so it
    never waits on NATS.
    """

    def __init__(self) -> None:
        self._snapshot: list[StreamStatus] = []
        self._ok = 0.0

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("sf_broker_up", "1 if the last JetStream poll succeeded")
        up.add_metric([], self._ok)
        msgs = GaugeMetricFamily("sf_stream_messages", "Messages in the stream", labels=["stream"])
        size = GaugeMetricFamily("sf_stream_bytes", "Bytes in the stream", labels=["stream"])
        labels = ["stream", "consumer"]
        pending = GaugeMetricFamily(
            "sf_consumer_pending", "Messages not yet delivered to the consumer", labels=labels
        )
        ack_pending = GaugeMetricFamily(
            "sf_consumer_ack_pending", "Messages delivered but not yet acked", labels=labels
        )
        redelivered = GaugeMetricFamily(
            "sf_consumer_redelivered", "Messages delivered more than once", labels=labels
        )
        for s in self._snapshot:
            msgs.add_metric([s.name], s.messages)
            size.add_metric([s.name], s.bytes)
            for c in s.consumers:
                pending.add_metric([s.name, c.name], c.pending)
                ack_pending.add_metric([s.name, c.name], c.ack_pending)
                redelivered.add_metric([s.name, c.name], c.redelivered)
        yield from (up, msgs, size, pending, ack_pending, redelivered)

    async def refresh(self, http: httpx.AsyncClient, monitoring_url: str) -> None:
        reply = await http.get(
            f"{monitoring_url}/jsz", params={"accounts": 1, "streams": 1, "consumers": 1}
        )
        reply.raise_for_status()
        self._snapshot = [
            StreamStatus(
                stream["name"],
                stream["state"].get("messages", 0),
                stream["state"].get("bytes", 0),
                [
                    ConsumerStatus(
                        c["name"],
                        c.get("num_pending", 0),
                        c.get("num_ack_pending", 0),
                        c.get("num_redelivered", 0),
                    )
                    for c in stream.get("consumer_detail") or []
                ],
            )
            for account in reply.json().get("account_details") or []
            for stream in account.get("stream_detail") or []
        ]

    async def poll(self, monitoring_url: str, stop: asyncio.Event, interval: float = 2.0) -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:
            while not stop.is_set():
                await self._poll_once(http, monitoring_url)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)

    async def _poll_once(self, http: httpx.AsyncClient, monitoring_url: str) -> None:
        try:
            await self.refresh(http, monitoring_url)
            self._ok = 1.0
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._ok = 0.0
            log.warning(kv("stream_poll_failed", error=f"{type(exc).__name__}: {exc}"))
