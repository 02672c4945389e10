"""What operators and the scheduler see of many workers on one run, on real worker subprocesses
and a real nats-server: the weight rhythm and quarantine (registry entry, ``seamlessflow
status``, the worker's and the scheduler's metrics) while another worker keeps serving, and the
seconds each worker spends per role, busy and idle, against the wall time measured here.

The quarantine is the existing fault: a load deadline (``weight_load_timeout_s``) shorter than
the load. To hold it long enough to look at, the quarantined worker runs the emulated engine,
whose load takes a configured time (``--engine-weight-load-s``); the other serves on the real
``hf`` engine."""

import asyncio
import io
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from broker.messages import FinishReason, Role, WeightsState
from broker.registry import Registration, read_registry
from broker.weights import publish_weights
from common.metrics import serve_metrics
from seamlessflow.launcher import print_workers, scrape_role_seconds
from seamlessflow.processes import worker_process
from tagsched.metrics import REGISTRY as SCHEDULER_METRICS
from tests.support import (
    eventually,
    free_port,
    metric,
    perturbed_weights,
    registered,
    status_workers,
)
from tests.test_liveness import leading
from tests.test_tagsched import ask
from tests.test_worker import Call

pytestmark = pytest.mark.newest_nats

LOAD_S = 25.0
"""How long the quarantined worker's load takes: its deadline is 0.5 s."""


def scheduled(name: str, **labels: str) -> float | None:
    return SCHEDULER_METRICS.get_sample_value(name, labels)


async def status_rows(url: str, run: str) -> dict[str, dict[str, str]]:
    """``seamlessflow status``'s registry table: each worker's cells by column."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "seamlessflow.cli", "status", "--nats", url, "--run", run],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return status_workers(done.stdout)


def _cells(row: dict[str, str], *columns: str) -> list[str]:
    return [row[c] for c in columns]


async def test_a_quarantined_worker_is_seen_while_another_serves_and_rejoins_current(
    broker, nc, js, names, tiny_model_dir
):
    """Two workers, one scheduler. A version's load overruns its deadline on "wa" only: its
    entry, its metrics, the scheduler's gauges and ``seamlessflow status`` say it is loading and
    quarantined, while "wb" serves every request on the new version. Once the load ends "wa"
    rejoins at the current version (ready, not quarantined) and serves again."""
    common = ("--heartbeat-s", "0.5", "--max-model-len", "2048")
    stuck = worker_process(
        broker.url,
        names.run,
        tiny_model_dir,
        "wa",
        *common,
        *("--engine", "emulated", "--engine-weight-load-s", str(LOAD_S)),
        *("--weight-load-timeout-s", "0.5"),
    )
    serving = worker_process(broker.url, names.run, tiny_model_dir, "wb", *common)
    try:
        await asyncio.gather(*(asyncio.to_thread(w.wait_ready) for w in (stuck, serving)))
        async with leading(nc, names) as s:
            await eventually(lambda: set(s.live()) == {"wa", "wb"})
            await publish_weights(js, names, 1, perturbed_weights(tiny_model_dir, seed=1))
            quarantined_at = time.monotonic()

            async def held(wid: str, version: int) -> bool:
                entry = await registered(js, names, wid)
                return entry.version == version and not entry.quarantined

            await eventually(lambda: _quarantined(js, names, "wa"))
            await eventually(lambda: held("wb", 1))
            entry = await registered(js, names, "wa")
            assert entry.weights is WeightsState.LOADING and entry.version == 0, entry
            assert await metric(stuck.metrics_url, "sf_rollout_quarantined") == 1
            assert await metric(stuck.metrics_url, "sf_rollout_weights_state", state="loading") == 1
            # the scheduler sees it
            await eventually(
                lambda: (
                    (
                        scheduled("sf_scheduler_workers_quarantined"),
                        scheduled("sf_scheduler_workers_weights", state="loading"),
                        scheduled("sf_scheduler_workers_weights", state="ready"),
                    )
                    == (1, 1, 1)
                )
            )

            # seamlessflow status shows both
            rows = await status_rows(broker.url, names.run)
            rhythm = ("weights", "wave", "quarantined")
            assert _cells(rows["wa"], *rhythm) == ["loading", "-", "yes"], rows["wa"]
            assert _cells(rows["wb"], "version", "busy", *rhythm) == ["1", "no", "ready", "-", "no"]
            assert rows["wb"]["busy/idle s"].startswith("rollout="), rows["wb"]

            # the other worker serves meanwhile, on the new version
            calls = [
                await Call(nc, names, f"cq{i}", max_tokens=8, temperature=0).start()
                for i in range(3)
            ]
            for call in calls:
                last = await call.finished()
                assert last.finish_reason is FinishReason.LENGTH, last
                assert {(c.worker_id, c.version) for c in call.chunks} == {("wb", 1)}
            print(f"status and calls done {time.monotonic() - quarantined_at:.1f} s into it")

            # all of that during the quarantine
            assert (await registered(js, names, "wa")).quarantined

            # it rejoins at the current version
            await eventually(lambda: held("wa", 1), timeout=LOAD_S + 30)
            entry = await registered(js, names, "wa")
            assert entry.weights is WeightsState.READY, entry
            await eventually(lambda: scheduled("sf_scheduler_workers_quarantined") == 0)
            assert await metric(stuck.metrics_url, "sf_rollout_quarantines_total") == 1
            assert await metric(stuck.metrics_url, "sf_rollout_quarantined") == 0
            rows = await status_rows(broker.url, names.run)
            assert _cells(rows["wa"], "version", "busy", *rhythm) == ["1", "no", "ready", "-", "no"]
        serving.stop()  # only the rejoined worker is left to serve
        again = await Call(nc, names, "cq-after", max_tokens=4, temperature=0).start()
        await again.finished()
        assert {(c.worker_id, c.version) for c in again.chunks} == {("wa", 1)}
    finally:
        for w in (stuck, serving):
            w.stop()


async def _quarantined(js, names, wid: str) -> bool:
    entry = await registered(js, names, wid)
    return entry is not None and entry.quarantined


IDLE_S = 3.0
TOLERANCE_S = 0.3
"""How far a worker's seconds in one (role, state) may be from the wall time measured here
(role changes timed by their acks, a busy stretch from the request's publication to its last
chunk): off by about 10 ms either way when measured, on a shared two-core machine."""


async def test_busy_and_idle_seconds_per_role_follow_the_wall_time(
    broker, nc, js, names, tiny_model_dir
):
    """Idle for a measured time in the idle role, then in rollout idle, busy for a measured
    request, idle again: ``sf_worker_role_seconds`` for each (role, state) matches the wall
    time within ``TOLERANCE_S``, and the roles it never held stay at 0."""
    w = worker_process(broker.url, names.run, tiny_model_dir, "wt", "--max-model-len", "2048")
    w.wait_ready()

    async def seconds() -> dict[tuple[str, str], float]:
        found = await scrape_role_seconds(await read_registry(js, names))
        assert found["wt"] is not None
        return found["wt"]

    try:
        assert (await ask(nc, names, "wt", Role.IDLE, 1)).ok
        idle_from = time.monotonic()
        before = await seconds()  # rollout's time ends with the change: fixed from here
        await asyncio.sleep(IDLE_S)
        assert (await ask(nc, names, "wt", Role.ROLLOUT, 2)).ok
        rollout_from = time.monotonic()
        idled = await seconds()  # the idle role's time ends with the change: fixed from here
        await asyncio.sleep(1.0)
        call = await Call(nc, names, "busy", max_tokens=600, temperature=0).start()
        started = time.monotonic()
        await call.finished()
        busy = time.monotonic() - started
        await asyncio.sleep(1.0)
        assert (await ask(nc, names, "wt", Role.IDLE, 3)).ok
        rollout = time.monotonic() - rollout_from
        after = await seconds()
    finally:
        w.stop()
    measured = {
        ("idle", "idle"): (idled[("idle", "idle")], rollout_from - idle_from),
        ("rollout", "busy"): (after[("rollout", "busy")] - before[("rollout", "busy")], busy),
        ("rollout", "idle"): (
            after[("rollout", "idle")] - before[("rollout", "idle")],
            rollout - busy,
        ),
    }
    print({k: (round(got, 3), round(wall, 3)) for k, (got, wall) in measured.items()})
    for key, (got, wall) in measured.items():
        assert abs(got - wall) <= TOLERANCE_S, (key, got, wall)
    assert busy > 0.5  # long enough for the bound above to mean something
    for key in (("idle", "busy"), ("train", "busy"), ("train", "idle")):
        assert after[key] == 0, key


async def test_status_shows_what_it_could_not_read(js, names):
    """A worker whose ``/metrics`` does not answer (gone, another network) or answers as another
    process (nothing there names the worker: a ``127.0.0.1`` URL read from another host) shows
    "?" for its seconds, one without ``metrics_url`` "-"; the table still shows every row."""
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    other = serve_metrics(CollectorRegistry())  # a /metrics, but no worker's
    try:
        for wid, url in (("w-dead", dead), ("w-other", other.url), ("w-none", None)):
            fields = {"tags": ["rollout"], "role": Role.ROLLOUT, "metrics_url": url}
            await (await Registration.open(js, names, wid, **fields)).put()
        found = await read_registry(js, names)
        seconds = await scrape_role_seconds(found)
    finally:
        other.close()
    assert seconds == {"w-dead": None, "w-other": None}
    out = io.StringIO()
    print_workers(found, None, out, role_seconds=seconds)
    rows = status_workers(out.getvalue())
    for w, seconds in (("w-dead", "?"), ("w-other", "?"), ("w-none", "-")):
        cells = _cells(rows[w], "weights", "wave", "quarantined", "busy/idle s")
        assert cells == ["ready", "-", "no", seconds], rows
