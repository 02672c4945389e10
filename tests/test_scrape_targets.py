"""``seamlessflow.targets``: the run's Prometheus file_sd file follows the worker registry."""

import asyncio
import contextlib
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram

from broker.messages import Role
from broker.registry import Registration
from common.exceptions import SeamlessFlowError
from common.metrics import metric_mean, scrape_all, serve_metrics
from seamlessflow.targets import ScrapeTargets
from tests.support import eventually, free_port


async def test_targets_follow_workers_as_they_register_and_leave(js, names, tmp_path):
    path = tmp_path / "targets" / "scrape_targets.json"
    targets = ScrapeTargets(path, names.run)
    assert json.loads(path.read_text()) == []
    targets.add("http://127.0.0.1:9460/metrics", "broker")
    targets.add("http://127.0.0.1:9500/metrics", "trainer")

    def listed() -> dict[str, dict]:
        return {g["targets"][0]: g["labels"] for g in json.loads(path.read_text())}

    follow = asyncio.create_task(targets.follow(js, names))
    worker = await Registration.open(
        js, names, "w1", tags=["rollout"], role=Role.ROLLOUT, metrics_url="http://10.0.0.2:9470/m"
    )
    trainer = await Registration.open(  # a started process that registers: listed once
        js,
        names,
        "t0",
        tags=["train"],
        role=Role.TRAIN,
        metrics_url="http://127.0.0.1:9500/metrics",
    )
    await worker.put()
    await trainer.put()
    await eventually(lambda: "10.0.0.2:9470" in listed(), watch=follow)
    assert listed() == {
        "127.0.0.1:9460": {
            "job": "seamlessflow-broker",
            "run": names.run,
            "__metrics_path__": "/metrics",
        },
        "127.0.0.1:9500": {
            "job": "seamlessflow-trainer",
            "run": names.run,
            "__metrics_path__": "/metrics",
        },
        "10.0.0.2:9470": {"job": "seamlessflow-worker", "run": names.run, "__metrics_path__": "/m"},
    }
    assert not list(path.parent.glob(".*"))  # written by rename: no temporary file left

    await worker.delete()
    await eventually(lambda: "10.0.0.2:9470" not in listed(), watch=follow)
    follow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await follow
    targets.clear()
    assert json.loads(path.read_text()) == []


def test_targets_refuse_a_bad_url_or_kind(tmp_path):
    targets = ScrapeTargets(tmp_path / "t.json", "r")
    for url in ("127.0.0.1:9460", "http://h:abc/metrics", "http://h:99999/metrics"):
        with pytest.raises(SeamlessFlowError, match="not an http://host:port"):
            targets.add(url, "broker")
    with pytest.raises(SeamlessFlowError, match="unknown process kind 'planner'"):
        targets.add("http://127.0.0.1:9460/metrics", "planner")
    assert json.loads((tmp_path / "t.json").read_text()) == []


def test_scrape_all_reads_every_endpoint_together_and_leaves_out_one_that_is_down(caplog):
    endpoints = []
    for seconds in (1.0, 3.0):
        registry = CollectorRegistry()
        Histogram("sf_test_seconds", "test", registry=registry).observe(seconds)
        endpoints.append(serve_metrics(registry))
    down = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    try:
        urls = [endpoints[0].url, down, endpoints[1].url]
        samples = asyncio.run(scrape_all(urls))
    finally:
        for endpoint in endpoints:
            endpoint.server.shutdown()
    assert metric_mean(samples, "sf_test_seconds") == 2.0  # both live ones, summed
    assert metric_mean(samples, "sf_test_absent") is None
    assert any("metrics_unreadable" in r.message and down in r.message for r in caplog.records)
