"""Roles are leases the worker enforces, and the scheduler's state survives failover: real
nats-servers, real worker and scheduler processes (``docs/protocol.md`` section 7)."""

import asyncio
import os
import signal
import time

from broker import codec
from broker.client import session
from broker.messages import Role, SchedulerState, WorkerRegistered
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import RunNames, StateKey
from seamlessflow.processes import worker_process
from tagsched.spec import Demand, PlacementSpec
from tests.support import SMALL_RUN, broker_config, eventually, metric, registered
from tests.test_tagsched import fenced, scheduler


async def scheduler_state(js, names: RunNames) -> SchedulerState:
    bucket = await js.key_value(names.state_kv)
    return codec.decode(SchedulerState, (await bucket.get(StateKey.SCHEDULER)).value)


async def record_entries(js, names: RunNames, worker_id: str, into: list[WorkerRegistered]):
    """Append every write of ``worker_id``'s registry entry to ``into`` (until cancelled)."""
    bucket = await js.key_value(names.workers_kv)
    watcher = await bucket.watch(worker_id)
    try:
        async for found in watcher:
            if found is not None and found.value:
                into.append(codec.decode(WorkerRegistered, found.value))
    finally:
        await watcher.stop()


async def test_a_worker_frozen_during_a_request_and_continued_late_does_not_take_the_role(
    broker, nc, js, names, tiny_model_dir
):
    """An idle worker is frozen (SIGSTOP); a scheduler wants it serving: the request (deadline
    1 s) finds it frozen and the scheduler fences it. Continued 3 s later, the worker reads the
    request past its expiry and refuses it: no entry of it ever holds that epoch (the old worker
    measured the deadline from its late receipt and took the role the scheduler had given up
    on). It then reads its fence, comes back as a new registration, is re-admitted and given
    the role afresh, with a higher epoch."""
    args = ("--role", "idle", "--heartbeat-s", "0.5")
    w = worker_process(broker.url, names.run, tiny_model_dir, "w-a", *args).wait_ready()
    entries: list[WorkerRegistered] = []
    watching = asyncio.create_task(record_entries(js, names, "w-a", entries))
    stop, running = asyncio.Event(), None
    try:
        first = await registered(js, names, "w-a")
        assert first is not None and first.role is Role.IDLE
        w.proc.send_signal(signal.SIGSTOP)
        serving = Demand(tags=["rollout"])
        spec = PlacementSpec(train=Demand(tags=["train"], count=0), rollout=serving)
        s = scheduler(nc, names, spec, role_change_deadline_s=1.0, tick_s=0.1)
        before = fenced()
        running = asyncio.create_task(s.run(stop))
        await eventually(lambda: fenced() == before + 1, watch=running)

        async def stored() -> bool:  # by the next tick
            return (await scheduler_state(js, names)).fence("w-a") is not None

        await eventually(stored, watch=running)
        fence = (await scheduler_state(js, names)).fence("w-a")
        assert fence is not None and fence.started_at == first.started_at
        assert s._workers["w-a"].role is Role.IDLE  # the scheduler never saw it take the role
        await asyncio.sleep(2.0)  # well past the request's deadline
        w.proc.send_signal(signal.SIGCONT)

        async def readmitted_serving() -> bool:
            e = await registered(js, names, "w-a")
            return e is not None and e.role is Role.ROLLOUT and "w-a" in s.live()

        await eventually(readmitted_serving, timeout=30, watch=running)
        expired = await metric(w.metrics_url, "sf_worker_role_changes_total", outcome="expired")
        given_up = await metric(w.metrics_url, "sf_worker_roles_given_up_total", reason="fenced")
        now = await registered(js, names, "w-a")
    finally:
        stop.set()
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        if running is not None:
            await asyncio.wait_for(running, 30)
        w.proc.send_signal(signal.SIGCONT)
        w.stop()
    assert expired == 1 and given_up == 1
    assert all(e.epoch != fence.epoch for e in entries), [(e.role, e.epoch) for e in entries]
    assert now is not None and now.epoch > fence.epoch and now.started_at != first.started_at


async def test_a_worker_cut_off_from_the_broker_goes_idle_within_its_lease(
    nats_binary, tmp_path, tiny_model_dir
):
    """A broker of its own, registry TTL 3 s (so a role lease of 2 s), paused with SIGSTOP: the
    connection stays up and nothing answers, as on a cut link. The serving worker goes idle by
    itself (stops fetching and routing) within its lease, before the TTL after which a
    scheduler gives its role to another; the broker back, its entry shows it idle as a new
    registration (which re-admits it). The old worker kept serving."""
    provision = SMALL_RUN.model_copy(update={"workers_ttl_s": 3.0})
    names = RunNames("cut")
    with EmbeddedBroker(broker_config(tmp_path / "broker", nats_binary)) as own:
        async with session(own.url, "pytest-cut") as nc:
            js = nc.jetstream()
            await provision_run(js, names.run, provision)
            w = worker_process(
                own.url, names.run, tiny_model_dir, "w-cut", "--heartbeat-s", "0.5"
            ).wait_ready()
            try:
                before = await registered(js, names, "w-cut")
                assert before is not None and before.role is Role.ROLLOUT
                assert await metric(w.metrics_url, "sf_worker_role_lease_seconds") == 2.0
                assert own.pid is not None
                os.kill(own.pid, signal.SIGSTOP)
                cut = time.monotonic()
                try:

                    async def idle() -> bool:
                        return await metric(w.metrics_url, "sf_worker_role", role="idle") == 1

                    await eventually(idle, timeout=20)
                    took = time.monotonic() - cut
                    rollout = await metric(w.metrics_url, "sf_worker_role", role="rollout")
                    lease = await metric(
                        w.metrics_url, "sf_worker_roles_given_up_total", reason="lease"
                    )
                finally:
                    os.kill(own.pid, signal.SIGCONT)

                async def back_idle() -> bool:
                    e = await registered(js, names, "w-cut")
                    return e is not None and e.role is Role.IDLE

                await eventually(back_idle, timeout=30)
                after = await registered(js, names, "w-cut")
            finally:
                w.stop()
    print(f"cut off: idle after {took:.2f}s (lease 2 s, registry TTL 3 s)")
    assert took < provision.workers_ttl_s and rollout == 0 and lease == 1
    assert after is not None and after.started_at != before.started_at
