"""Service processes started by SeamlessFlow itself (tests, benchmarks, the local launcher).

``ServiceProcess`` runs one ``seamlessflow <command>`` as a child process, reads its output in a
thread (kept for error reports), and knows it is serving once the command writes its ready
handshake (``common.ready``): one JSON object on a pipe of its own, never its output, so no log
line can be mistaken for it. Every long-running command (``broker``, ``worker``, ``gateway``,
``trajectory``, ``trainer``, ``agents``, ``scheduler``) writes one. ``restart`` starts the same
command again (a supervisor's restart after the process exited). ``stop_all`` stops a run's
processes, the callers before what they call, each tier's processes together.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from broker.server import die_with_parent
from common.ready import READY_FD
from seamlessflow.exceptions import ServiceProcessError


class SuperviseConfig(BaseModel):
    """How ``seamlessflow run`` restarts a child process that exits: after a backoff that
    doubles with each exit in a row, and ending the run only when one keeps failing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_restarts: int = Field(
        default=5, ge=0, description="exits in a row (none up stable_s) before the run ends"
    )
    backoff_s: float = Field(default=1.0, gt=0, description="wait before the first restart")
    backoff_max_s: float = Field(default=30.0, gt=0, description="longest wait before a restart")
    stable_s: float = Field(
        default=60.0, gt=0, description="up this long after a restart: its exits in a row reset"
    )


class ServiceProcess:
    """A ``seamlessflow <args>`` child process.

    ``threads`` sets ``OMP_NUM_THREADS`` for it: several torch processes sharing a few cores run
    faster with one torch thread each. ``cpus`` pins it (and the processes it starts) to those
    CPUs, and tells vLLM's CPU backend to bind its threads there too; without ``cpus`` vLLM is
    told not to bind at all. ``env`` adds environment variables.
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
        self.args = list(args)
        """Its arguments; a restart uses them as they are then (a port pinned meanwhile)."""
        self._env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        if threads is not None:
            self._env["OMP_NUM_THREADS"] = str(threads)
        if cpus is not None:
            allowed = os.sched_getaffinity(0)
            if not cpus or not cpus <= allowed:
                raise ServiceProcessError(
                    f"{name}: CPUs {sorted(cpus)} are not a non-empty subset of the CPUs this "
                    f"process may use, {sorted(allowed)}"
                )
            self._env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
        else:
            # Anywhere means anywhere: vLLM's own CPU binding would pin its worker to a core and
            # spin its scheduler on another, taking both from whatever shares the machine.
            self._env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self._cpus = cpus
        self.output: deque[str] = deque(maxlen=400)
        self._spawn()

    def _spawn(self) -> None:
        self.metrics_url = ""
        self.handshake: dict = {}
        """The child's ready handshake (``common.ready``), once it serves."""
        self.started_at = time.monotonic()
        self._ready = threading.Event()
        ready_r, ready_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "seamlessflow.cli", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**self._env, READY_FD: str(ready_w)},
                pass_fds=(ready_w,),
                # Its own session: Ctrl-C reaches the launcher, which stops children in order;
                # and it dies with the launcher even when that is killed.
                start_new_session=True,
                preexec_fn=die_with_parent if self._cpus is None else partial(_pin, self._cpus),
            )
        finally:
            os.close(ready_w)  # the child's copy is the only writer
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        threading.Thread(target=self._handshake, args=(ready_r, self._ready), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.output.append(line)

    def _handshake(self, fd: int, ready: threading.Event) -> None:
        """Take the child's handshake; a pipe closed without one (it exited) leaves it unset."""
        with os.fdopen(fd) as pipe:
            line = pipe.readline()
        try:
            handshake = json.loads(line) if line else {}
        except json.JSONDecodeError:
            self.output.append(f"--- {self.name}: unreadable ready handshake {line!r} ---\n")
            handshake = {}
        if handshake.get("metrics_url"):
            self.handshake = handshake
            self.metrics_url = handshake["metrics_url"]
            ready.set()

    def tail(self, lines: int = 20) -> str:
        """Its last ``lines`` lines of output."""
        return "".join(list(self.output)[-lines:])

    def restart(self) -> None:
        """Start the command again; the process must have exited. Its output goes on in
        ``output``, after a line saying so."""
        if self.proc.poll() is None:
            raise ServiceProcessError(f"{self.name} is still running: stop it first")
        self.output.append(f"--- {self.name} restarted (exit code {self.proc.returncode}) ---\n")
        self._spawn()

    @property
    def serving(self) -> bool:
        """Whether it wrote its ready handshake (and is still running)."""
        return self._ready.is_set() and self.proc.poll() is None

    def wait_ready(self, timeout: float = 120.0) -> "ServiceProcess":
        """Return once the process serves; stop it and raise if it exits or is not serving in
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                break
        if self._ready.is_set():
            return self
        self.stop()
        code = self.proc.returncode
        problem = f"exited with code {code}" if code else f"did not start within {timeout:g}s"
        raise ServiceProcessError(f"{self.name} {problem}:\n{''.join(self.output)}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGTERM: a clean stop) and wait; past ``timeout``, ask for its threads'
        stacks (SIGUSR1: they go to its output, for the error), then SIGKILL and raise."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)  # the reader thread takes the dump in
            self.proc.kill()
            self.proc.wait()
            raise ServiceProcessError(
                f"{self.name} did not stop within {timeout:g}s:\n{''.join(self.output)}"
            ) from None


# The order ``stop_all`` stops commands in, a tier's together: the callers before what they call,
# the workers and the trainer (most of a run's processes) at once, the broker last.
STOP_TIERS = (
    ("agents",),
    ("gateway",),
    ("worker", "trainer"),
    ("trajectory",),
    ("scheduler",),
    ("broker",),
)


def stop_all(
    procs: list[ServiceProcess], sig: int = signal.SIGTERM, timeout: float = 30.0
) -> list[ServiceProcessError]:
    """Stop ``procs`` tier by tier (``STOP_TIERS``; a command not named there goes first), each
    of a tier on a thread of its own: a tier takes its slowest stop, not the sum of its stops.
    Returns the errors of those that did not stop within ``timeout`` (killed); every other
    process is stopped whatever they did."""

    def tier(proc: ServiceProcess) -> int:
        return next((i for i, t in enumerate(STOP_TIERS) if proc.command in t), -1)

    errors = []
    for level in sorted({tier(p) for p in procs}):
        group = [p for p in procs if tier(p) == level]
        with ThreadPoolExecutor(len(group)) as pool:
            futures = [pool.submit(p.stop, sig, timeout) for p in group]
        for future in futures:
            try:
                future.result()
            except ServiceProcessError as exc:
                errors.append(exc)
    return errors


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
