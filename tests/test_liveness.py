"""Liveness never compares two machines' clocks: a worker whose wall clock is minutes off is seen
live by the scheduler, the trainer's serving watch and ``seamlessflow status`` while it renews its
registry entry, and dead within the TTL once it stops.

Two ways to skew a clock: ``SkewedClock``, a fault injector handed to ``Registration`` (its
``wall_clock``, which writes ``heartbeat_at``), in this process; and libfaketime preloaded into a
real ``seamlessflow worker`` child process (its ``time.time()`` five minutes behind; monotonic
time untouched), skipped where libfaketime is not installed (Debian: ``apt-get install
faketime``)."""

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from broker import registry
from broker.client import session
from broker.messages import Role
from broker.provision import provision_run
from broker.registry import LastSeen, Registration, Sighting, read_registry
from broker.subjects import RunNames
from broker.worker_messages import WorkerRegistered
from seamlessflow.launcher import print_workers, workers_and_leader
from seamlessflow.processes import worker_process
from tagsched.admission import Admission
from tagsched.config import SchedulerConfig
from tagsched.scheduler import Scheduler
from tagsched.spec import Demand, PlacementSpec
from tests.nodes import STATE_IN_NODE, Cluster
from tests.nodes import available as nodes_unavailable
from tests.support import SMALL_RUN, eventually, frozen
from trainer.watch import ServingWatch

TTL = 3.0
HEARTBEAT = 0.5
SKEW = 300.0  # five minutes: far past the TTL either way
SERVE_ALL = PlacementSpec(train=Demand(tags=["train"], count=0), rollout=Demand(tags=["rollout"]))
FAKETIME = next(
    (
        p
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
            Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
            Path("/usr/lib/faketime/libfaketimeMT.so.1"),
        )
        if p.is_file()
    ),
    None,
)


def _faketime_env() -> dict[str, str]:
    """A process's wall clock ``SKEW`` seconds behind, its monotonic clock and file times not."""
    return {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": f"-{SKEW:g}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "DONT_FAKE_MONOTONIC": "1",
        "NO_FAKE_STAT": "1",
    }


class SkewedClock:
    """Fault injector: a wall clock ``offset`` seconds off this machine's, as on another node
    whose clock drifted."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


def entry(wid: str) -> WorkerRegistered:
    return WorkerRegistered(
        worker_id=wid, host="n", pid=1, tags=["rollout"], role=Role.ROLLOUT, heartbeat_at=0.0
    )


def test_last_seen_judges_by_the_observers_clock_only():
    now = [100.0]
    seen = LastSeen(clock=lambda: now[0])
    # heartbeat_at says 1970 and the year 2100: neither matters, only when it was written
    seen.saw(Sighting("a", entry("a").model_copy(update={"heartbeat_at": 0.0}), written_at=99.0))
    seen.saw(Sighting("b", entry("b").model_copy(update={"heartbeat_at": 4.1e9}), written_at=90.0))
    assert seen.fresh("a", 3.0) and not seen.fresh("b", 3.0)
    assert seen.age("a") == 1.0 and seen.age("c") is None and not seen.fresh("c", 3.0)
    now[0] = 102.5
    assert not seen.fresh("a", 3.0)
    seen.saw(Sighting("a", entry("a"), written_at=102.0))  # renewed
    assert seen.fresh("a", 3.0)
    seen.saw(Sighting("a", None, written_at=102.4))  # deleted
    assert seen.age("a") is None


@asynccontextmanager
async def leading(
    nc, names: RunNames, spec: PlacementSpec = SERVE_ALL, **config: float
) -> AsyncIterator[Scheduler]:
    """A scheduler leading the run by ``spec`` (default: every rollout-tagged worker serves)
    with ``TTL``, until the block ends."""
    s = Scheduler(
        nc,
        names,
        SchedulerConfig(tick_s=0.1, placement_timeout_s=600, **config),
        spec,
        Admission(nc.jetstream(), names, SMALL_RUN.tasks),
        workers_ttl_s=TTL,
        lease_s=SMALL_RUN.scheduler_lease_s,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    try:
        yield s
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


@pytest.fixture
async def short_ttl(js, run_name: str) -> RunNames:
    """A run whose worker entries expire ``TTL`` seconds after their last write."""
    await provision_run(js, run_name, SMALL_RUN.model_copy(update={"workers_ttl_s": TTL}))
    return RunNames(run_name)


async def test_skewed_clocks_are_live_while_renewing_and_dead_within_the_ttl(nc, js, short_ttl):
    """Three workers renew every 0.5 s: one's clock right, one's five minutes behind, one's five
    minutes ahead (by heartbeat_at, the behind one looks dead and the ahead one immortal). The
    scheduler, the serving watch and status see all three live, with their true ages; each
    skewed one that stops renewing (frozen, its entry left) is dead within the TTL."""
    names = short_ttl
    offsets = {"w-right": 0.0, "w-behind": -SKEW, "w-ahead": SKEW}
    regs = {
        wid: await Registration.open(
            js, names, wid, tags=["rollout"], role=Role.ROLLOUT, wall_clock=SkewedClock(off)
        )
        for wid, off in offsets.items()
    }
    for r in regs.values():
        await r.put()
    beats = {wid: asyncio.create_task(r.keep_alive(HEARTBEAT)) for wid, r in regs.items()}
    watch = ServingWatch(TTL)
    following = asyncio.create_task(watch.follow(js, names))
    try:
        async with leading(nc, names) as s:
            await eventually(lambda: set(s.live()) == set(offsets), watch=following)
            await eventually(lambda: set(watch.live()) == set(offsets), watch=following)
            # they stay live, heartbeat after heartbeat
            for _ in range(int(2 * TTL / 0.25)):
                await asyncio.sleep(0.25)
                assert set(s.live()) == set(offsets) == set(watch.live())

            # status: dated by the server's clock, each worker's clock offset shown
            found = {x.worker_id: x for x in await read_registry(js, names)}
            assert set(found) == set(offsets)
            for wid, off in offsets.items():
                assert found[wid].dated and found[wid].age() < 2 * HEARTBEAT + 0.5, wid
                assert abs(found[wid].clock_offset() - off) < 1.0, wid
            out = io.StringIO()
            print_workers(list(found.values()), None, out, ttl=TTL)
            rows = {line.split()[0]: line.split() for line in out.getvalue().splitlines()[2:-1]}
            assert rows["w-behind"][-1].startswith("-300") and rows["w-ahead"][-1] == "+300.0s"
            assert rows["w-right"][-1] == "ok" and rows["w-right"][1] == regs["w-right"].entry.host
            assert "not renewed" not in out.getvalue()

            # the two skewed ones stop renewing, their entries left in place
            for wid in ("w-behind", "w-ahead"):
                beats[wid].cancel()
            await asyncio.gather(beats["w-behind"], beats["w-ahead"], return_exceptions=True)
            stopped = time.monotonic()
            await eventually(lambda: set(s.live()) == {"w-right"}, timeout=TTL + 5)
            await eventually(lambda: set(watch.live()) == {"w-right"}, timeout=TTL + 5)
            gone = time.monotonic() - stopped
            # dead within the TTL (of the last write, at most a heartbeat before the stop) and
            # not long before it
            assert TTL - HEARTBEAT - 0.5 <= gone <= TTL + 1.0, gone
            assert "w-right" in s.live()
    finally:
        following.cancel()
        for b in beats.values():
            b.cancel()
        await asyncio.gather(following, *beats.values(), return_exceptions=True)


async def test_status_dates_entries_by_the_servers_clock(nc, js, short_ttl):
    """An entry written five minutes "ago" by its writer's clock but just now by the server's
    is fresh; one that stops renewing ages from its last write, and is reported as not renewed
    once past the TTL (while the bucket still holds it)."""
    names = short_ttl
    r = await Registration.open(
        js, names, "w-old", tags=["rollout"], role=Role.ROLLOUT, wall_clock=SkewedClock(-SKEW)
    )
    await r.put()
    (found,) = await read_registry(js, names)
    assert found.dated and found.age() < 1.0 and found.clock_offset() < -SKEW + 1
    await asyncio.sleep(1.5)
    (found,) = await read_registry(js, names)
    assert 1.4 <= found.age() < 2.5
    out = io.StringIO()
    print_workers([found], "s-1", out, ttl=1.0)
    assert "(not renewed within 1s)" in out.getvalue()
    assert "scheduler: s-1" in out.getvalue()


@pytest.mark.newest_nats
@pytest.mark.skipif(FAKETIME is None, reason="no libfaketime (apt-get install faketime)")
async def test_a_real_worker_five_minutes_behind_is_live_until_frozen(
    broker, nc, js, short_ttl, tiny_model_dir
):
    """A real ``seamlessflow worker`` whose wall clock libfaketime puts five minutes behind
    (monotonic time untouched) registers and renews: the scheduler and ``seamlessflow status``
    see it live, status shows its clock 300 s behind. Frozen (SIGSTOP), it stops renewing: the
    scheduler drops it within the TTL."""
    names = short_ttl
    skewed = _faketime_env()
    w = worker_process(
        broker.url,
        names.run,
        tiny_model_dir,
        "w-skewed",
        "--tags",
        "rollout",
        "--heartbeat-s",
        str(HEARTBEAT),
        env=skewed,
    )
    try:
        await asyncio.to_thread(w.wait_ready)
        async with leading(nc, names) as s:
            await eventually(lambda: "w-skewed" in s.live(), timeout=30)
            (found,) = await read_registry(js, names)
            assert abs(found.clock_offset() + SKEW) < 5, found.clock_offset()
            assert time.time() - found.entry.heartbeat_at > SKEW - 5  # heartbeat_at is off
            command = ["status", "--nats", broker.url, "--run", names.run]
            status = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "seamlessflow.cli", *command],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ},
            )
            assert status.returncode == 0, status.stderr
            row = next(x for x in status.stdout.splitlines() if x.startswith("w-skewed"))
            assert row.split()[1] == found.entry.host and "not renewed" not in row, row
            assert row.split()[-1].startswith("-30"), row  # about -300.0s
            await asyncio.sleep(2 * TTL)
            assert "w-skewed" in s.live()  # renewing, by the scheduler's clock

            w.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            await eventually(lambda: "w-skewed" not in s.live(), timeout=TTL + 5)
            assert time.monotonic() - stopped <= TTL + 1.0
    finally:
        # Killed, not stopped: a rollout worker sometimes outlives SIGTERM by more than 30 s
        # after "worker_stopped" (seen here with and without libfaketime; not about liveness).
        w.proc.send_signal(signal.SIGCONT)
        w.stop(signal.SIGKILL)


@pytest.mark.cluster
@pytest.mark.newest_nats
@pytest.mark.skipif(FAKETIME is None, reason="no libfaketime (apt-get install faketime)")
@pytest.mark.skipif(nodes_unavailable() is not None, reason=str(nodes_unavailable()))
async def test_across_nodes_a_worker_five_minutes_behind_is_live_and_shows_its_node(
    nats_binary, tiny_model_dir, tmp_path
):
    """Three nodes (``tests.nodes``): the broker on one, a real worker on another with its wall
    clock five minutes behind (libfaketime), ``seamlessflow status`` on the third; the scheduler
    runs on this machine. Status names the worker's node (its hostname) and its clock 300 s
    behind; the scheduler sees it live until it is frozen, then dead within the TTL."""
    with Cluster(3, tmp_path / "nodes") as cluster:
        broker_node, worker_node, status_node = cluster
        conf = {
            "listen": "0.0.0.0:4222",
            "jetstream": {"store_dir": str(STATE_IN_NODE / "nats" / "jetstream")},
        }
        (broker_node.state_dir / "nats.conf").write_text(json.dumps(conf))
        broker_node.run([nats_binary, "-c", STATE_IN_NODE / "nats.conf"])
        url = f"nats://{broker_node.address}:4222"
        async with session(url, "pytest-liveness", give_up_after=30) as nc:
            js = nc.jetstream()
            await eventually(lambda: _jetstream_up(js), timeout=30)
            names = RunNames("nodes")
            await provision_run(js, names.run, SMALL_RUN.model_copy(update={"workers_ttl_s": TTL}))
            argv = [sys.executable, "-m", "seamlessflow.cli", "worker", "--nats", url]
            argv += ["--run", names.run, "--model", str(tiny_model_dir), "--worker-id", "w-far"]
            argv += ["--tags", "rollout", "--heartbeat-s", str(HEARTBEAT)]
            env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **_faketime_env()}
            worker = worker_node.run(argv, env)
            try:
                async with leading(nc, names) as s:
                    await eventually(lambda: "w-far" in s.live(), timeout=120)
                    command = ["status", "--nats", url, "--run", names.run]
                    out = await asyncio.to_thread(
                        status_node.exec, [sys.executable, "-m", "seamlessflow.cli", *command]
                    )
                    row = next(x.split() for x in out.splitlines() if x.startswith("w-far "))
                    assert row[1] == worker_node.hostname, out
                    assert row[-1].startswith("-30") and "not" not in row, out  # -300.0s
                    await asyncio.sleep(2 * TTL)
                    assert "w-far" in s.live()
                    worker.send_signal(signal.SIGSTOP)
                    stopped = time.monotonic()
                    await eventually(lambda: "w-far" not in s.live(), timeout=TTL + 5)
                    assert time.monotonic() - stopped <= TTL + 1.0
            finally:
                worker.send_signal(signal.SIGCONT)
                worker.terminate()


async def _jetstream_up(js) -> bool:
    try:
        await js.account_info()
    except NatsError:
        return False
    return True


async def test_a_read_finds_the_current_entries_while_they_are_rewritten(js, short_ttl):
    """nats-py's end-of-current marker can come before the entries its consumer delivered: a
    read must wait for them (status once showed no workers while one renewed every 50 ms)."""
    names = short_ttl
    r = await Registration.open(js, names, "w-busy", tags=["rollout"], role=Role.ROLLOUT)
    await r.put()
    beat = asyncio.create_task(r.keep_alive(0.05))
    try:
        for _ in range(60):
            found = await read_registry(js, names)
            assert [x.worker_id for x in found] == ["w-busy"] and found[0].age() < 1.0
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)


class _MarkerLost(asyncio.Queue):
    """FAULT INJECTION (named fake): a watcher's update queue that loses nats-py's
    end-of-current marker, as a watch on a 2.9 server once did (a read waited forever); it
    cannot be made to happen on demand."""

    def put_nowait(self, item) -> None:
        if item is not None:
            super().put_nowait(item)


async def test_a_read_whose_current_entries_stall_watches_again(js, short_ttl, monkeypatch):
    names = short_ttl
    await (await Registration.open(js, names, "w-1", tags=["rollout"], role=Role.ROLLOUT)).put()
    monkeypatch.setattr(registry, "CURRENT_STALL_S", 0.5)
    made: list[KeyValue.KeyWatcher] = []

    class FirstLosesItsMarker(KeyValue.KeyWatcher):
        def __init__(self, js) -> None:
            super().__init__(js)
            if not made:
                self._updates = _MarkerLost(maxsize=256)
            made.append(self)

    monkeypatch.setattr(KeyValue, "KeyWatcher", FirstLosesItsMarker)
    started = time.monotonic()
    found = await asyncio.wait_for(read_registry(js, names), 10)
    assert [x.worker_id for x in found] == ["w-1"]
    assert len(made) == 2 and 0.5 <= time.monotonic() - started < 5


async def test_a_summary_waits_for_the_broker_to_read_the_registry_then_goes_without(
    broker, nc, names
):
    """The run's summary reads the registry at its end, maybe just after a broker restart or a
    lost cluster server (CI saw ``seamlessflow run`` exit 1 on one timeout there). A broker that
    cannot answer is waited for; past ``give_up_s`` the summary goes without the workers."""
    js = nc.jetstream(timeout=0.5)
    await (await Registration.open(js, names, "w-1", tags=["rollout"], role=Role.ROLLOUT)).put()
    async with frozen(broker.pid):
        started = time.monotonic()
        assert await workers_and_leader(js, names, give_up_s=1.5) == ([], None)
        assert 1.5 <= time.monotonic() - started < 10
        reading = asyncio.create_task(workers_and_leader(js, names, give_up_s=60))
        await asyncio.sleep(2.0)
        assert not reading.done()
    workers, leader = await asyncio.wait_for(reading, 30)
    assert [w.worker_id for w in workers] == ["w-1"] and leader is None


def test_the_serving_watch_counts_every_worker_that_may_load_a_version():
    """``ServingWatch.live`` is the rollout role; ``engines`` (whom a held version must reach by
    a file) is that and every worker tagged ``rollout``, a valued tag included, in any role."""
    watch = ServingWatch(TTL)
    now = time.monotonic()
    workers = {
        "placed-by-gpu": (["gpu=0"], Role.ROLLOUT),  # a custom rollout demand's tag
        "lent-back": (["train", "rollout"], Role.TRAIN),
        "valued": (["rollout=big"], Role.IDLE),
        "trains-only": (["train"], Role.TRAIN),
    }
    for wid, (tags, role) in workers.items():
        entry = WorkerRegistered(
            worker_id=wid, host="h", pid=1, tags=tags, role=role, heartbeat_at=0.0
        )
        watch.seen(Sighting(wid, entry, written_at=now))
    assert set(watch.live()) == {"placed-by-gpu"}
    assert set(watch.engines()) == {"placed-by-gpu", "lent-back", "valued"}
    watch.seen(Sighting("lent-back", None, written_at=now))  # deleted
    assert set(watch.engines()) == {"placed-by-gpu", "valued"}
    stale = WorkerRegistered(
        worker_id="old", host="h", pid=1, tags=["rollout"], role=Role.ROLLOUT, heartbeat_at=0.0
    )
    watch.seen(Sighting("old", stale, written_at=now - 2 * TTL))  # not written within the TTL
    assert "old" not in watch.engines() and "old" not in watch.live()
