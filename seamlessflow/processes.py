"""Service processes started by SeamlessFlow itself (tests, benchmarks, the local launcher).

``ServiceProcess`` runs one ``seamlessflow <command>`` as a child process, reads its output in a
thread (kept for error reports), and knows it is serving once the command prints its ready line:
a line containing ``ready:`` and ending in ``metrics=<url>``. Every long-running command
(``worker``, ``gateway``, ``trajectory``, ``trainer``, ``agents``) prints one.
"""

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from broker.server import die_with_parent
from common.exceptions import SeamlessFlowError

READY = "ready:"
"""What a long-running ``seamlessflow`` command prints once it is serving."""


class ServiceProcessError(SeamlessFlowError):
    """A service process did not start or did not stop in time."""


class ServiceProcess:
    """A ``seamlessflow <args>`` child process.

    ``threads`` sets ``OMP_NUM_THREADS`` for it: several torch processes sharing a few cores run
    faster with one torch thread each. ``cpus`` pins it (and the processes it starts) to those
    CPUs, and tells vLLM's CPU backend to bind its threads there too. ``env`` adds environment
    variables.
    """

    def __init__(
        self,
        name: str,
        *args: str,
        threads: int | None = 1,
        cpus: frozenset[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.command = args[0]
        """The ``seamlessflow`` subcommand it runs (``worker``, ``trainer``, ...)."""
        command = [sys.executable, "-m", "seamlessflow.cli", *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        if threads is not None:
            full_env["OMP_NUM_THREADS"] = str(threads)
        if cpus is not None:
            allowed = os.sched_getaffinity(0)
            if not cpus or not cpus <= allowed:
                raise ServiceProcessError(
                    f"{name}: CPUs {sorted(cpus)} are not a non-empty subset of the CPUs this "
                    f"process may use, {sorted(allowed)}"
                )
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            # Its own session: Ctrl-C reaches the launcher, which stops children in order; and it
            # dies with the launcher even when that is killed.
            start_new_session=True,
            preexec_fn=die_with_parent if cpus is None else lambda: _pin(cpus),
        )
        self.output: deque[str] = deque(maxlen=400)
        self.metrics_url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if READY in line and not self._ready.is_set():
                self.metrics_url = line.rsplit("metrics=", 1)[1].strip()
                self._ready.set()
        self._ready.set()  # exited: wake a waiter

    def wait_ready(self, timeout: float = 120.0) -> "ServiceProcess":
        """Return once the process serves; stop it and raise if it exits or is not serving in
        ``timeout`` seconds."""
        if self._ready.wait(timeout) and self.metrics_url:
            return self
        self.stop()
        code = self.proc.returncode
        problem = f"exited with code {code}" if code else f"did not start within {timeout:g}s"
        raise ServiceProcessError(f"{self.name} {problem}:\n{''.join(self.output)}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGTERM: a clean stop) and wait; SIGKILL and raise past ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise ServiceProcessError(
                f"{self.name} did not stop within {timeout:g}s:\n{''.join(self.output)}"
            ) from None


def _pin(cpus: frozenset[int]) -> None:
    """In the child, before it runs: die with the parent, run on ``cpus`` only."""
    die_with_parent()
    os.sched_setaffinity(0, cpus)


def worker_process(
    url: str,
    run: str,
    model: Path,
    worker_id: str,
    *args: str,
    threads: int | None = 1,
    cpus: frozenset[int] | None = None,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """A ``seamlessflow worker`` (a real rollout worker with its own engine). ``args`` are extra
    command-line arguments (``--engine vllm``, ``--max-running 16``, ...)."""
    command = ["worker", "--nats", url, "--run", run, "--model", str(model)]
    return ServiceProcess(
        f"worker {worker_id}",
        *command,
        "--worker-id",
        worker_id,
        *args,
        threads=threads,
        cpus=cpus,
        env=env,
    )
