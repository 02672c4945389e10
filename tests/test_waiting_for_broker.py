"""Every long-running service started before its broker (a node's worker up first, a broker
restarting) waits for it and then serves, rather than exiting after the first connect's
timeout and leaving the restart to a supervisor. Real ``seamlessflow`` processes and a real
nats-server, stopped and started again on the same port and store."""

import asyncio
import time

import pytest

from broker.client import WAIT_LOG_S, session
from broker.provision import durable_info, provision_run
from broker.server import EmbeddedBroker
from broker.subjects import Durable, RunNames
from seamlessflow.processes import ServiceProcess, worker_process
from tests.support import SMALL_RUN, broker_config, eventually, free_port, own_run

OLD_GIVE_UP_S = 5.0
"""What a service's first connect waited before it failed the process (and a JetStream
request's timeout)."""


def _waiting(proc: ServiceProcess) -> bool:
    assert proc.proc.poll() is None, f"{proc.name} exited:\n{proc.tail(40)}"
    return "nats_waiting" in "".join(proc.output)


@pytest.mark.newest_nats
async def test_services_started_before_their_broker_wait_for_it_then_serve(
    tmp_path, nats_binary, tiny_model_dir, monkeypatch
):
    cfg = broker_config(tmp_path / "broker", nats_binary).model_copy(update={"port": free_port()})
    run = "waits"
    server = EmbeddedBroker(cfg)
    admin = own_run(server, run, monkeypatch)  # the children connect as their principals
    server.start()
    try:
        async with session(server.url, "test", identity_file=admin) as nc:
            await provision_run(nc.jetstream(), run, SMALL_RUN)
    finally:
        server.stop()
    url, model = server.url, str(tiny_model_dir)
    config = tmp_path / "run.toml"
    config.write_text(f'run = "{run}"\n[scheduler]\nplacement_timeout_s = 600.0\n')
    common = ("--nats", url, "--run", run)
    procs = [
        ServiceProcess("trajectory", "trajectory", *common),
        ServiceProcess("scheduler", "scheduler", "--nats", url, "--config", str(config)),
        ServiceProcess("agents", "agents", *common, "--gateway", "http://127.0.0.1:9"),
        ServiceProcess("gateway", "gateway", *common, "--model", model, "--port", "0"),
        ServiceProcess("trainer", "trainer", *common, "--model", model),
        worker_process(url, run, tiny_model_dir, "w1", "--engine", "hf"),
    ]
    started = time.monotonic()
    try:
        for proc in procs:  # each has reached its connect (the engine and trainer load first)
            await eventually(lambda p=proc: _waiting(p), timeout=180)
        await asyncio.sleep(OLD_GIVE_UP_S + 3.0)
        for proc in procs:
            assert proc.proc.poll() is None, f"{proc.name} exited:\n{proc.tail(40)}"
            assert not proc.serving
        waited = time.monotonic() - started
        server = EmbeddedBroker(cfg).start()
        for proc in procs:
            await asyncio.to_thread(proc.wait_ready, 120)
        output = {proc.name: "".join(proc.output) for proc in procs}
        for name, text in output.items():
            assert "nats_connected" in text, f"{name}:\n{text}"
            # one line, then one every WAIT_LOG_S: not one per attempt (2 a second)
            assert text.count("nats_waiting") <= 1 + waited / WAIT_LOG_S, f"{name}:\n{text}"
    finally:
        codes = {proc.name: proc.stop() for proc in procs}
        server.stop()
    assert codes == {proc.name: 0 for proc in procs}


async def test_a_service_stopped_while_it_waits_for_its_broker_exits_cleanly():
    proc = ServiceProcess(
        "trajectory", "trajectory", "--nats", f"nats://127.0.0.1:{free_port()}", "--run", "gone"
    )
    try:
        await eventually(lambda: _waiting(proc), timeout=60)
        asked = time.monotonic()
        code = proc.stop(timeout=10)
    finally:
        proc.stop()
    assert code == 0
    assert time.monotonic() - asked < 5.0
    assert "stopped while waiting for NATS at nats://127.0.0.1:" in "".join(proc.output)


@pytest.mark.newest_nats
async def test_a_services_start_up_lookup_waits_for_a_broker_that_went_away(tmp_path, nats_binary):
    cfg = broker_config(tmp_path / "broker", nats_binary).model_copy(update={"port": free_port()})
    names = RunNames("lookup")
    server = EmbeddedBroker(cfg)
    admin = own_run(server, names.run)
    server.start()
    stop = asyncio.Event()
    try:
        async with session(server.url, "test", identity_file=admin) as nc:
            js = nc.jetstream()
            await provision_run(js, names.run, SMALL_RUN)
            server.stop()
            lookup = asyncio.create_task(
                durable_info(js, names, names.traj_stream, Durable.TRAJECTORY, stop=stop)
            )
            await asyncio.sleep(OLD_GIVE_UP_S + 3.0)  # past a JetStream request's timeout
            assert not lookup.done(), lookup
            server = EmbeddedBroker(cfg).start()
            info = await asyncio.wait_for(lookup, 30)
        assert info.name == Durable.TRAJECTORY
    finally:
        stop.set()
        server.stop()
