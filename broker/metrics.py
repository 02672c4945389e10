"""The data plane's own metrics: ingress outcomes and JetStream depths."""

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.provision import StreamStatus, stream_status
from common.log import kv

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

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


class StreamDepthCollector(Collector):
    """Reports the depth of every JetStream stream and durable consumer on the server.

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

    async def refresh(self, js: JetStreamContext) -> None:
        self._snapshot = [await stream_status(js, info) for info in await js.streams_info()]

    async def poll(self, js: JetStreamContext, stop: asyncio.Event, interval: float = 2.0) -> None:
        while not stop.is_set():
            try:
                await self.refresh(js)
                self._ok = 1.0
            except (NatsError, TimeoutError) as exc:
                self._ok = 0.0
                log.warning(kv("stream_poll_failed", error=f"{type(exc).__name__}: {exc}"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
