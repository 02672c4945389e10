"""``seamlessflow run``'s supervision of its children, on real ``seamlessflow`` processes: a
child that exits is restarted after a backoff, and one that keeps failing ends the run."""

import json
import os
import signal
import time

import pytest

from common.ready import READY_FD, announce_ready, claim_handshake
from seamlessflow.exceptions import ServiceProcessError
from seamlessflow.processes import ServiceProcess, SuperviseConfig, stop_all
from seamlessflow.run import _Supervised


def _tick_until(supervised: _Supervised, cfg: SuperviseConfig, done, timeout: float) -> bool:
    """Tick like the run's loop (quicker) until ``done()``; returns whether a tick said the
    process serves again."""
    deadline, again = time.monotonic() + timeout, False
    while not done():
        assert time.monotonic() < deadline, "".join(supervised.proc.output)
        again = supervised.tick(cfg) or again
        time.sleep(0.05)
    return again


@pytest.mark.newest_nats
def test_a_killed_child_is_restarted_and_serves_again(broker, names):
    cfg = SuperviseConfig(backoff_s=0.5)
    proc = ServiceProcess("trajectory", "trajectory", "--nats", broker.url, "--run", names.run)
    proc.wait_ready()
    assert proc.handshake == {
        "process": "trajectory",
        "metrics_url": proc.metrics_url,
        "run": names.run,
    }
    supervised = _Supervised(proc)
    try:
        first_pid = proc.proc.pid
        proc.proc.send_signal(signal.SIGKILL)
        exited = time.monotonic()
        again = _tick_until(supervised, cfg, lambda: supervised.restarts == 1, 10)
        assert time.monotonic() - exited >= cfg.backoff_s  # waited for the backoff
        again = _tick_until(supervised, cfg, lambda: proc.serving, 60) or again
        again = again or supervised.tick(cfg)
        assert again and proc.proc.pid != first_pid
        assert supervised.status() == "trajectory restarted 1x"
        assert supervised.failures == 1  # reset only once it stays up stable_s
        assert "restarted (exit code -9)" in "".join(proc.output)
    finally:
        proc.stop()


def test_a_child_that_keeps_failing_is_given_up_after_max_restarts(capsys):
    cfg = SuperviseConfig(max_restarts=2, backoff_s=0.1, backoff_max_s=0.2)
    proc = ServiceProcess("broken", "trajectory", "--no-such-flag")  # argparse: exit code 2
    supervised = _Supervised(proc)
    _tick_until(supervised, cfg, lambda: supervised.failures > cfg.max_restarts, 60)
    assert supervised.restarts == cfg.max_restarts
    assert proc.proc.returncode == 2
    # each restart shows why the child exited (CI once saw only "exited with code 1")
    printed = capsys.readouterr().out
    assert printed.count("--- broken's last lines ---") == cfg.max_restarts
    assert "error: the following arguments are required: --nats" in printed
    time.sleep(0.5)
    supervised.tick(cfg)
    assert supervised.restarts == cfg.max_restarts  # not restarted again: the run ends
    assert supervised.status() == "broken down"


def test_the_ready_handshake_is_one_json_object_on_a_pipe_of_its_own(monkeypatch, capsys):
    """The launcher reads readiness from the pipe, never the output: the child takes the pipe
    out of its environment (its own children neither see nor inherit it), writes one object
    and closes it; a second announcement is printed only."""
    read, write = os.pipe()
    monkeypatch.setenv(READY_FD, str(write))
    claim_handshake()
    assert READY_FD not in os.environ and not os.get_inheritable(write)
    url = "http://127.0.0.1:9/metrics"
    announce_ready("trainer", url, run="r", version=3)
    announce_ready("trainer", url, run="r", version=4)
    with os.fdopen(read) as pipe:  # at EOF: the writer closed it after one object
        sent = [json.loads(line) for line in pipe]
    assert sent == [{"process": "trainer", "metrics_url": url, "run": "r", "version": 3}]
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"trainer ready: run=r version={v} metrics={url}" for v in (3, 4)]


def test_a_child_that_does_not_stop_in_time_shows_where_it_was(tmp_path):
    """Past the stop timeout the child is asked for its threads' stacks (SIGUSR1), then killed:
    the error carries them. SIGCONT stands in for a stop signal the child does not act on."""
    proc = ServiceProcess("broker", "broker", "--state-dir", str(tmp_path / "broker"))
    proc.wait_ready(60)
    with pytest.raises(ServiceProcessError, match="did not stop") as stuck:
        proc.stop(signal.SIGCONT, timeout=0.5)
    assert "Thread 0x" in str(stuck.value) and 'File "' in str(stuck.value)
    assert proc.proc.returncode == -signal.SIGKILL


def test_a_runs_processes_of_one_tier_stop_together(tmp_path):
    """``stop_all`` waits for a tier's processes on threads of their own: three children that do
    not stop (SIGCONT again stands in for an ignored stop signal) are all killed, each reported,
    in about one stop timeout and its stack dump (1.5 s), not three in a row (4.5 s)."""
    procs = [
        ServiceProcess(f"broker {i}", "broker", "--state-dir", str(tmp_path / f"b{i}"))
        for i in range(3)
    ]
    for proc in procs:
        proc.wait_ready(60)
    started = time.monotonic()
    errors = stop_all(procs, signal.SIGCONT, timeout=0.5)
    took = time.monotonic() - started
    assert sorted(str(e).split(" did not stop")[0] for e in errors) == [p.name for p in procs]
    assert [p.proc.returncode for p in procs] == [-signal.SIGKILL] * 3
    assert took < 3.0, f"stopped one after another: {took:.1f} s"
