"""The fault suite (marker ``faults``: ``make test-faults``, its own CI step): ``seamlessflow run``
on the tiny model against a real nats-server the test owns, while, one at a time, each kind of
child process is killed with SIGKILL (the run's supervision restarts it) and the broker is stopped
and started again on its store, once at an arbitrary moment and once as a trainer step commits
(its acks and weight publish in flight). Then the data the run left is checked:

- every group that ended has exactly ``group_size`` sessions, each with all its samples;
- every sample was trained exactly once or dropped with a reason (``steps.jsonl``), or is still
  unsettled on the trainer's consumer (the run was stopped): none lost, none twice;
- no message was dead-lettered; every process was alive at the end; versions are consecutive
  but where a killed trainer's checkpoint write was cut after its version was announced (that
  version stays taken: the next is at most 3 on, with ``checkpoint_every = 1``, set here).

A table (fault, seconds until two new versions, lost, twice, dropped) is printed. A trainer
step taken while the broker is down is checked on its own (deterministically: its group times
out during the outage): its acks and weights wait for the broker. The same run
on a 3-node NATS cluster (streams with 3 replicas) loses one node mid-run and goes on, with
the same checks.
"""

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from broker.auth import IDENTITIES_ENV, IDENTITY_ENV
from broker.client import session
from broker.messages import MessageRejected, SampleReady, SessionEnded
from broker.permissions import Principal
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import Durable, RunNames
from broker.tls import CA_ENV
from broker.weights import latest_weights
from common.metrics import scrape
from rollout.gateway.keys import read_key_file
from tests.support import (
    SMALL_RUN,
    NatsCluster,
    broker_config,
    eventually,
    free_port,
    stream_messages,
)
from tests.test_trainer import group, publish
from trainer import checkpoint
from trainer.config import TrainerConfig

pytestmark = [pytest.mark.faults]

GROUP = 4
CHILDREN = ("scheduler", "trajectory", "trainer", "rollout-0", "gateway", "agents")
RECOVERY_TIMEOUT_S = 150.0
CHILD_PID = re.compile(
    r"^(?:  )?(\S.*?)(?:\s+pid\s+| serving again \(pid )(\d+)\)?\s+(http://\S+/metrics)"
)
"""A child's pid and /metrics in the run's start listing or in its 'serving again' line."""


class RunProcess:
    """``seamlessflow run`` as a child process; its output read in a thread, the pid of each of
    its children taken from its start listing and its 'serving again' lines."""

    def __init__(self, config: Path, url: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "seamlessflow.cli", "run", str(config), "--nats", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.metrics: dict[str, str] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := CHILD_PID.match(line):
                self.pids[m[1]] = int(m[2])
                self.metrics[m[1]] = m[3]

    def tail(self, n: int = 80) -> str:
        return "".join(self.lines[-n:])


class Broker:
    """The run's nats-server, stopped and started again on the same port and store, with
    authorization on: the run's identities are issued first, and the run hands each of its
    processes its own (``$SEAMLESSFLOW_NATS_IDENTITIES``)."""

    def __init__(self, state_dir: Path, binary: Path, run: str = "faults") -> None:
        config = broker_config(state_dir, binary)
        self.config = config.model_copy(update={"port": free_port()})
        server = EmbeddedBroker(self.config)
        server.authority.issue_run(run)
        self.identities = server.authority.path(run, Principal.ADMIN).parent
        self.server = server.start()
        self.url = self.server.url

    def restart(self, down_s: float) -> None:
        self.server.stop()
        time.sleep(down_s)
        self.server = EmbeddedBroker(self.config).start()


def _steps(ckpt: Path) -> list[checkpoint.StepRecord]:
    return checkpoint.read_steps(ckpt) if (ckpt / checkpoint.STEPS_LOG).exists() else []


def _version(ckpt: Path) -> int:
    return max((s.version for s in _steps(ckpt)), default=0)


def _dropped(ckpt: Path) -> int:
    return sum(len(s.dropped) for s in _steps(ckpt))


async def _until(condition, timeout: float, run: RunProcess, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.proc.poll() is None, f"the run ended while waiting for {what}:\n{run.tail()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:g}s:\n{run.tail()}"
        await asyncio.sleep(0.2)


def _start_run(
    tmp_path: Path,
    url: str,
    run_toml: Callable[..., Path],
    replicas: int = 1,
    identities: Path | None = None,
    ca: Path | None = None,
) -> tuple[RunProcess, Path]:
    """``seamlessflow run`` (run name ``faults``) on ``url``, each process with its own identity
    from ``identities`` when given; returns it and its checkpoints."""
    config = run_toml(
        "faults",
        warm_start_steps=10,
        tasks={"group_size": GROUP},
        trainer={"groups_per_step": 2, "checkpoint_every": 1},  # none lost across a kill
        stop={"max_steps": 100000, "max_seconds": 900},
        supervise={"backoff_s": 0.5, "backoff_max_s": 2.0},
        provision={"replicas": replicas},
    )
    env = {**os.environ, "SEAMLESSFLOW_MODELS": str(tmp_path / "models"), "HF_HUB_OFFLINE": "1"}
    if identities is not None:
        env[IDENTITIES_ENV] = str(identities)
    if ca is not None:
        env[CA_ENV] = str(ca)
    return RunProcess(config, url, env), tmp_path / "out" / "checkpoints"


async def _stop_run(run: RunProcess) -> None:
    """Check every child is alive, then stop the run (Ctrl-C) and check it ends cleanly."""
    for child in CHILDREN:
        try:
            os.kill(run.pids[child], 0)
        except ProcessLookupError:
            pytest.fail(f"{child} (pid {run.pids[child]}) is gone, not restarted:\n{run.tail()}")
    assert " down" not in run.tail(5), run.tail()
    run.proc.send_signal(signal.SIGINT)
    code = await asyncio.to_thread(run.proc.wait, 180)
    assert code == 0, run.tail()
    assert "interrupted" in run.tail()


@pytest.mark.newest_nats
@pytest.mark.timeout(900)
async def test_run_survives_kills_and_broker_restarts_losing_nothing(
    nats_binary, tmp_path, run_toml
):
    broker = Broker(tmp_path / "broker", nats_binary)
    run, ckpt = _start_run(tmp_path, broker.url, run_toml, identities=broker.identities)
    table: list[tuple[str, float, int]] = []
    try:
        await _until(lambda: _version(ckpt) >= 2, 300, run, "version 2")

        async def fault(name: str, inject) -> None:
            before, dropped = _version(ckpt), _dropped(ckpt)
            started = time.monotonic()
            await inject()
            await _until(lambda: _version(ckpt) >= before + 2, RECOVERY_TIMEOUT_S, run, name)
            table.append((name, time.monotonic() - started, _dropped(ckpt) - dropped))

        for child in CHILDREN:

            async def kill(child: str = child) -> None:
                pid = run.pids[child]
                os.kill(pid, signal.SIGKILL)
                # Restarted by the run, serving again (a new pid).
                await _until(lambda: run.pids[child] != pid, 120, run, f"{child} restarted")

            await fault(f"SIGKILL {child}", kill)

        async def broker_down() -> None:
            await asyncio.to_thread(broker.restart, 5.0)

        await fault("broker stopped 5 s", broker_down)

        async def broker_down_mid_step() -> None:
            pointer = ckpt / checkpoint.LATEST
            committed = pointer.stat().st_mtime_ns
            await _until(lambda: pointer.stat().st_mtime_ns != committed, 60, run, "a step")
            await asyncio.to_thread(broker.restart, 2.0)

        await fault("broker stopped as a step commits", broker_down_mid_step)
        # What each process tried again across the two broker outages (since its last start).
        metrics_key = read_key_file(tmp_path / "out" / "metrics.key")  # the gateway's
        for child in CHILDREN:
            retried = [
                f"{x.labels['what']}={x.value:g}"
                for x in await scrape(run.metrics[child], metrics_key)
                if x.name == "sf_nats_retries_total"
            ]
            print(f"\n{child} NATS retries: {', '.join(retried) or 'none'}")

        await _stop_run(run)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()

    try:
        admin = broker.identities / "admin.toml"
        async with session(broker.url, "pytest-faults", identity_file=admin) as nc:
            lost, twice, why = await _check_the_data(nc, RunNames("faults"), ckpt)
    finally:
        broker.server.stop()
    print("\nfault | seconds to 2 new versions | lost | twice | dropped")
    for name, seconds, dropped in table:
        print(f"{name} | {seconds:.1f} | {lost} | {twice} | {dropped}")
    assert (lost, twice) == (0, 0), why


@pytest.mark.newest_nats
async def test_a_step_taken_while_the_broker_is_down_is_published_when_it_is_back(
    nats_binary, tiny_model_dir, tmp_path, caplog, monkeypatch
):
    """The trainer (in process) holds one session of a group of two; the broker stops; the group
    times out and is trained while the broker is down. The trainer does not die: its acks and
    its weight publish wait for the broker, and once it is back v1 is published (once), the
    sample is acked, and the next group makes v2."""
    from trainer.serve import serve_trainer

    caplog.set_level(logging.INFO, logger="broker.retry")
    broker = Broker(tmp_path / "broker", nats_binary, run="stepdown")
    names = RunNames("stepdown")
    monkeypatch.setenv(IDENTITY_ENV, str(broker.identities / "trainer.toml"))  # the trainer's
    config = TrainerConfig(
        lr=1e-3,
        groups_per_step=1,
        max_staleness=100,
        group_timeout_s=3.0,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=1,
        worker_id="trainer-d",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    try:
        admin = broker.identities / "admin.toml"
        async with session(broker.url, "pytest", identity_file=admin) as nc:
            js = nc.jetstream()
            await provision_run(js, names.run, SMALL_RUN)
            serving = asyncio.create_task(
                serve_trainer(broker.url, names.run, SMALL_RUN, config, tiny_model_dir, 0, stop)
            )

            async def held(count: int) -> bool:
                info = await js.consumer_info(names.samples_stream, Durable.TRAINER)
                return info.num_ack_pending == count and info.num_pending == 0

            a, b = group("a", 2), group("b", 2)
            await publish(js, names, a[0])
            await eventually(lambda: held(1), timeout=60, watch=serving)
            await asyncio.to_thread(broker.restart, 10.0)  # the group expires meanwhile
            await eventually(lambda: held(0), timeout=60, watch=serving)

            async def published() -> int:
                latest = await latest_weights(js, names)
                return latest.version if latest else 0

            await eventually(published, timeout=60, watch=serving)
            assert await published() == 1
            await publish(js, names, *b)
            await eventually(
                lambda: _version(config.checkpoint_dir) == 2, timeout=60, watch=serving
            )
            await eventually(lambda: held(0), timeout=30, watch=serving)
            stop.set()
            await asyncio.wait_for(serving, 60)  # raises what the trainer raised
            weights = await published()
    finally:
        stop.set()
        broker.server.stop()
    steps = checkpoint.read_steps(config.checkpoint_dir)
    assert [(s.version, s.trained) for s in steps] == [(1, (a[0].sample_id,)), (2, tuple(
        s.sample_id for s in b))]  # fmt: skip
    assert weights == 2
    retried = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nats_")]
    # Publishing waited for the broker: the host-local announcement (in the step) or the upload.
    publishing = ("what=weights_announce_local", "what=weights_publish")
    assert any(w in line for line in retried for w in publishing), retried
    recovered = tuple(f"nats_recovered {w}" for w in publishing)
    assert any(x.startswith(recovered) for x in retried), retried


@pytest.mark.newest_nats
@pytest.mark.timeout(600)
async def test_a_run_on_a_3_node_cluster_loses_a_node_and_goes_on(nats_binary, tmp_path, run_toml):
    """Streams and buckets with 3 replicas (from ``[provision] replicas``); the processes are
    given all three servers; one server is killed mid-run."""
    cluster = await NatsCluster(nats_binary, tmp_path / "cluster", run="faults").start()
    try:
        run, ckpt = _start_run(
            tmp_path, cluster.url, run_toml, 3, identities=cluster.identities, ca=cluster.ca
        )
        try:
            await _until(lambda: _version(ckpt) >= 2, 300, run, "version 2")
            before, started = _version(ckpt), time.monotonic()
            cluster.kill(0)
            await _until(lambda: _version(ckpt) >= before + 2, RECOVERY_TIMEOUT_S, run, "steps")
            seconds = time.monotonic() - started
            await _stop_run(run)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
        async with cluster.session("pytest-faults") as nc:
            info = await nc.jetstream().stream_info(RunNames("faults").samples_stream)
            assert info.config.num_replicas == 3
            lost, twice, why = await _check_the_data(nc, RunNames("faults"), ckpt)
    finally:
        cluster.stop()
    dropped = _dropped(ckpt)
    print(f"\n1 of 3 nodes killed | {seconds:.1f} | {lost} | {twice} | {dropped}")
    assert (lost, twice) == (0, 0), why


async def _check_the_data(nc: NATS, names: RunNames, ckpt: Path) -> tuple[int, int, str]:
    """Assert the invariants of the module docstring on what the run left (read through
    ``nc``, the run's admin); return (lost, twice) samples and what to look at if any were
    lost."""
    js = nc.jetstream()
    ended = await stream_messages(js, names.traj_stream, SessionEnded, subject=names.traj_end)
    samples = await stream_messages(js, names.samples_stream, SampleReady)
    dead = await stream_messages(js, names.dead_stream, MessageRejected)

    # What the trainer has not settled (the run was stopped): take it all back, unacked,
    # until every message not acked (delivered or not yet) is in hand: a pull the stopped trainer
    # left open may have been answered after it stopped reading, and those messages come
    # back only once ack_wait runs out.
    sub = await js.pull_subscribe_bind(Durable.TRAINER, names.samples_stream)
    unsettled: set[str] = set()
    held = 0
    async with asyncio.timeout(60):
        while True:
            try:
                msgs = await sub.fetch(256, timeout=3)
            except TimeoutError:
                info = await js.consumer_info(names.samples_stream, Durable.TRAINER)
                if info.num_ack_pending <= held and info.num_pending == 0:
                    break
                continue
            held += len(msgs)
            unsettled |= {m.headers.get("Nats-Msg-Id", "") for m in msgs if m.headers}
    await sub.unsubscribe()
    assert dead == [], [d.reason for d in dead]
    # Groups are whole, sessions have all their samples.
    sessions = defaultdict(set)
    for e in ended:
        sessions[e.group_id].add(e.session_id)
    assert {g: len(s) for g, s in sessions.items() if len(s) != GROUP} == {}
    per_session = Counter(s.session_id for s in {s.sample_id: s for s in samples}.values())
    for s in samples:
        assert per_session[s.session_id] == s.session_samples, s.session_id
    # Trained once or dropped with a reason, or still unsettled: none lost, none twice.
    steps = checkpoint.read_steps(ckpt)
    consumed = [sid for step in steps for sid in step.sample_ids]
    twice = len(consumed) - len(set(consumed))
    assert all(reason == "stale" for step in steps for _, reason in step.dropped)
    lost = {s.sample_id for s in samples} - set(consumed) - unsettled
    why = ""
    if lost:  # what to look at when it fails (CI once lost 4, never reproduced here)
        info = await js.consumer_info(names.samples_stream, Durable.TRAINER)
        in_step = {sid: step.version for step in steps for sid in step.sample_ids}
        for s in (s for s in samples if s.sample_id in lost):
            group = {
                m.sample_id: in_step.get(m.sample_id) for m in samples if m.group_id == s.group_id
            }
            why += f"lost {s.sample_id} (v{max(s.versions)}): its group's in steps {group}\n"
        why += (
            f"{len(lost)} lost of {len(samples)}, {len(steps)} steps, {held} unsettled; trainer "
            f"consumer: ack floor {info.ack_floor}, {info.num_redelivered} redelivered"
        )
    # Versions are consecutive (but after a cut checkpoint write); a step that trained nothing
    # made none.
    version = 0
    for step in steps:
        if step.trained:
            assert version < step.version <= version + 3, (version, step.version)
            version = step.version
        else:
            assert step.version == version
    return len(lost), twice, why
