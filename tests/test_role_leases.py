"""Roles are leases the worker enforces, and the scheduler's state survives failover: real
nats-servers, real worker and scheduler processes (``docs/protocol.md`` section 7)."""

import asyncio
import os
import signal
import time

import pytest

from broker import codec
from broker.client import session
from broker.control import Fence, SchedulerState
from broker.exceptions import RunNotProvisionedError
from broker.messages import Role
from broker.provision import provision_run
from broker.registry import Registration
from broker.roles import REGISTRY as ROLE_METRICS
from broker.roles import membership
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from broker.worker_messages import WorkerRegistered
from seamlessflow.processes import worker_process
from tagsched.exceptions import LeaseLostError
from tagsched.spec import Demand, PlacementSpec
from tagsched.state import StateStore
from tests.support import (
    SMALL_RUN,
    broker_config,
    eventually,
    metric,
    own_run,
    registered,
)
from tests.test_tagsched import fenced, scheduler


async def scheduler_state(js, names: RunNames) -> SchedulerState:
    bucket = await js.key_value(names.state_kv)
    return codec.decode(SchedulerState, (await bucket.get(RunNames.SCHEDULER_STATE_KEY)).value)


async def record_entries(
    js, names: RunNames, worker_id: str, into: list[WorkerRegistered], stop: asyncio.Event
) -> None:
    """Append every write of ``worker_id``'s registry entry to ``into``, until ``stop``."""
    bucket = await js.key_value(names.workers_kv)
    watcher = await bucket.watch(worker_id)
    try:
        while not stop.is_set():
            try:
                found = await watcher.updates(timeout=0.2)
            except TimeoutError:
                continue
            if found is not None and found.value:
                into.append(codec.decode(WorkerRegistered, found.value))
    finally:
        await watcher.stop()


async def test_a_deposed_schedulers_state_write_fails(js, names):
    """The state's revision is a fencing token: once a scheduler taking over has claimed the
    state, the one it deposed cannot write it (it stops leading), and what it wrote before is
    what the new one continues from."""
    first = await StateStore.open(js, names, "first")
    await first.claim()
    first.change(epoch=5)
    await first.flush()
    second = await StateStore.open(js, names, "second")
    taken = await second.claim()
    assert (taken.leader, taken.epoch) == ("second", 5)
    first.change(epoch=6)
    with pytest.raises(LeaseLostError, match="another scheduler wrote the run's state"):
        await first.flush()
    second.change(epoch=7)
    await second.flush()
    assert (await scheduler_state(js, names)).epoch == 7


async def test_a_run_provisioned_without_the_state_bucket_is_named(nc, js, names):
    """A worker of a run provisioned before the state bucket existed is told what to run."""
    await js.delete_key_value(names.state_kv)

    async def switch(role: Role) -> None:
        pass

    registration = await Registration.open(js, names, "old", tags=["rollout"], role=Role.IDLE)
    with pytest.raises(RunNotProvisionedError, match=f"no bucket {names.state_kv} .*provision"):
        async with membership(nc, names, registration, switch, heartbeat_s=0.1):
            pass
    assert await registered(js, names, "old") is None  # it left the registry on the way out


async def test_a_fenced_worker_gives_up_its_role_and_a_failing_switch_stops_no_heartbeat(
    nc, js, names
):
    """The scheduler's state fences a serving worker's registration (its ack was lost): with
    its next heartbeat the worker reads the fence and goes idle; here its switch fails, which is
    logged and counted, and the worker still begins a new registration and keeps renewing it."""
    taken: list[Role] = []

    async def switch(role: Role) -> None:
        taken.append(role)
        if role is Role.IDLE:
            raise RuntimeError("the engine would not pause")

    def given_up() -> float:
        return ROLE_METRICS.get_sample_value("sf_worker_roles_given_up_total", {"reason": "fenced"})

    before = given_up()
    registration = await Registration.open(js, names, "m", tags=["rollout"], role=Role.ROLLOUT)
    async with membership(nc, names, registration, switch, heartbeat_s=0.1):
        first = await registered(js, names, "m")
        assert first is not None
        fence = Fence(worker_id="m", started_at=first.started_at, epoch=3)
        state = SchedulerState(leader="s", epoch=3, fenced=[fence])
        bucket = await js.key_value(names.state_kv)
        await bucket.put(RunNames.SCHEDULER_STATE_KEY, codec.encode(state))

        async def renewed() -> bool:
            e = await registered(js, names, "m")
            return e is not None and e.started_at != first.started_at

        await eventually(renewed)
        again = await registered(js, names, "m")
        await asyncio.sleep(0.3)
        later = await registered(js, names, "m")
    assert taken == [Role.ROLLOUT, Role.IDLE] and given_up() == before + 1
    assert later.heartbeat_at > again.heartbeat_at  # the heartbeats go on


@pytest.mark.newest_nats
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
    stop, running = asyncio.Event(), None
    watching = asyncio.create_task(record_entries(js, names, "w-a", entries, stop))
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
        await watching
        if running is not None:
            await asyncio.wait_for(running, 30)
        w.proc.send_signal(signal.SIGCONT)
        w.stop()
    assert expired == 1 and given_up == 1
    assert all(e.epoch != fence.epoch for e in entries), [(e.role, e.epoch) for e in entries]
    assert now is not None and now.epoch > fence.epoch and now.started_at != first.started_at


@pytest.mark.newest_nats
async def test_a_worker_cut_off_from_the_broker_goes_idle_within_its_lease(
    nats_binary, tmp_path, tiny_model_dir, monkeypatch
):
    """A broker of its own, registry TTL 3 s (so a role lease of 2 s), paused with SIGSTOP: the
    connection stays up and nothing answers, as on a cut link. The serving worker goes idle by
    itself (stops fetching and routing) within its lease, before the TTL after which a
    scheduler gives its role to another; the broker back, its entry shows it idle as a new
    registration (which re-admits it). The old worker kept serving."""
    provision = SMALL_RUN.model_copy(update={"workers_ttl_s": 3.0})
    names = RunNames("cut")
    own = EmbeddedBroker(broker_config(tmp_path / "broker", nats_binary))
    admin = own_run(own, names.run, monkeypatch)
    with own:
        async with session(own.url, "pytest-cut", identity_file=admin) as nc:
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


@pytest.mark.newest_nats
async def test_failover_mid_lend_continues_roles_epochs_lends_and_admission(
    broker, js, names, tiny_model_dir, run_toml
):
    """A multiplexed layout: one worker holding the trainer too (tagged train,rollout), started
    training; scheduler ``first`` leads and lends it to rollout (the trainer waits for a batch);
    ``second`` stands by. ``first`` is killed (-9) mid-lend and mid-admission: ``second`` leads
    within 5 s, continues the lend (it sends the worker nothing), and once samples make a batch
    ready reclaims the worker with an epoch above every epoch ``first`` handed out, then lends
    it again. Then ``second`` is killed (-9) and restarted at once: it takes its own lease over
    and leads within 5 s. Every task submitted is admitted once: 0 lost, 0 twice,
    with rising tickets."""
    from nats.errors import TimeoutError as NatsTimeoutError

    from broker.messages import TaskSubmitted
    from broker.subjects import Durable
    from seamlessflow.processes import ServiceProcess
    from seamlessflow.submit import submit_tasks
    from tests.test_tagsched import task
    from tests.test_trainer import group, publish

    config = run_toml(
        names.run,
        trainer={"groups_per_step": 1, "max_staleness": 4},
        layout={"kind": "multiplexed"},
        scheduler={"tick_s": 0.1},
    )
    args = ("--tags", "train,rollout", "--role", "train", "--heartbeat-s", "0.5")
    tw = worker_process(broker.url, names.run, tiny_model_dir, "tw", *args, "--config", str(config))

    def start(name: str) -> ServiceProcess:
        command = ("scheduler", "--nats", broker.url, "--config", str(config))
        return ServiceProcess(name, *command, "--scheduler-id", name)

    async def leads(p: ServiceProcess) -> bool:
        return p.serving and await metric(p.metrics_url, "sf_scheduler_leader") == 1

    entries: list[WorkerRegistered] = []
    watched = asyncio.Event()
    watching = asyncio.create_task(record_entries(js, names, "tw", entries, watched))
    agents = await js.pull_subscribe_bind(durable=Durable.AGENTS, stream=names.tasks_stream)
    got: list[str] = []
    tickets: list[int] = []

    async def agent() -> None:
        """An agent runner that finishes each admitted task at once (no samples)."""
        while True:
            try:
                msgs = await agents.fetch(1, timeout=0.5)
            except NatsTimeoutError:
                continue
            for msg in msgs:
                admitted = codec.decode(TaskSubmitted, msg.data)
                got.append(admitted.task_id)
                assert admitted.admitted is not None
                tickets.append(admitted.admitted.ticket)
                await msg.ack()
            await asyncio.sleep(0.3)

    async def lent_at(above: int) -> int:
        """Wait for the worker to be lent (rollout) with an epoch above ``above``; that epoch."""

        async def lent() -> bool:
            return any(e.role is Role.ROLLOUT and e.epoch > above for e in entries)

        await eventually(lent, timeout=60)
        return max(e.epoch for e in entries if e.role is Role.ROLLOUT)

    finishing = asyncio.create_task(agent())
    first = start("first")
    second = None
    tasks = [task(f"t{i}") for i in range(12)]
    try:
        await asyncio.to_thread(tw.wait_ready)
        first.wait_ready()
        second = start("second").wait_ready()
        await eventually(lambda: leads(first), timeout=30)
        lend = await lent_at(0)
        assert not await leads(second)
        await submit_tasks(js, names, tasks[:6], progress=False)
        await eventually(lambda: len(got) >= 2, timeout=30)
        first.proc.kill()  # mid-lend, mid-admission
        killed = time.monotonic()
        await eventually(lambda: leads(second), timeout=30)
        standby_s = time.monotonic() - killed
        state = await scheduler_state(js, names)
        assert state.leader == "second" and state.epoch >= lend
        await asyncio.sleep(1.5)  # the lend goes on: nothing is sent to the worker
        assert (await registered(js, names, "tw")).epoch == lend
        # A batch is ready: reclaimed (above first's epochs), trains, is lent again.
        await publish(js, names, *group("g1", 2))

        async def reclaimed() -> bool:
            return any(e.role is Role.TRAIN and e.epoch > lend for e in entries)

        await eventually(reclaimed, timeout=60)
        again = await lent_at(lend + 1)
        await eventually(lambda: len(got) == 6, timeout=60)
        # Killed and restarted at once: its own lease, taken over.
        await submit_tasks(js, names, tasks[6:], progress=False)
        await eventually(lambda: len(got) >= 8, timeout=30)
        second.proc.kill()
        second.proc.wait()
        killed = time.monotonic()
        second.restart()
        await eventually(lambda: leads(second), timeout=30)
        restart_s = time.monotonic() - killed
        await eventually(lambda: len(got) == 12, timeout=60)
        await asyncio.sleep(1.0)
    finally:
        finishing.cancel()
        watched.set()
        await asyncio.gather(finishing, watching, return_exceptions=True)
        for p in (first, second, tw):
            if p is not None:
                p.stop()
    print(f"failover: standby led {standby_s:.2f}s after kill -9, restarted {restart_s:.2f}s")
    assert sorted(got) == sorted(t.task_id for t in tasks)  # 0 lost, 0 twice
    # Admission tickets rise across both failovers (stored before a task carries one)
    assert tickets == sorted(set(tickets)) and tickets[0] == 1, tickets
    epochs = [e.epoch for e in entries]
    assert epochs == sorted(epochs) and again > lend  # epochs never went back
    roles: dict[int, set[Role]] = {}
    for e in entries:
        roles.setdefault(e.epoch, set()).add(e.role)
    assert all(len(held) == 1 for held in roles.values()), roles  # an epoch is one change
    assert standby_s < 5.0 and restart_s < 5.0
