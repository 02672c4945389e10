"""``seamlessflow run``'s supervision of its children, on real ``seamlessflow`` processes: a
child that exits is restarted after a backoff, and one that keeps failing ends the run."""

import signal
import time

import pytest

from seamlessflow.processes import ServiceProcess, SuperviseConfig
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


def test_a_child_that_keeps_failing_is_given_up_after_max_restarts():
    cfg = SuperviseConfig(max_restarts=2, backoff_s=0.1, backoff_max_s=0.2)
    proc = ServiceProcess("broken", "trajectory", "--no-such-flag")  # argparse: exit code 2
    supervised = _Supervised(proc)
    _tick_until(supervised, cfg, lambda: supervised.failures > cfg.max_restarts, 60)
    assert supervised.restarts == cfg.max_restarts
    assert proc.proc.returncode == 2
    time.sleep(0.5)
    supervised.tick(cfg)
    assert supervised.restarts == cfg.max_restarts  # not restarted again: the run ends
    assert supervised.status() == "broken down"
