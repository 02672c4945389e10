"""Worker processes started by SeamlessFlow itself (tests, benchmarks, the local launcher).

``WorkerProcess`` runs ``seamlessflow worker`` as a child process, reads its output in a thread
(kept for error reports), and knows it is serving once the worker prints its ready line.
"""

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from seamlessflow.exceptions import SeamlessFlowError

READY = "ready:"
"""What ``seamlessflow worker`` prints once it is registered and consuming."""


class WorkerProcessError(SeamlessFlowError):
    """A worker process did not start or did not stop in time."""


class WorkerProcess:
    """A ``seamlessflow worker`` child process (a real rollout worker with its own engine).

    ``args`` are extra command-line arguments (``--engine vllm``, ``--max-running 16``, ...).
    ``threads`` sets ``OMP_NUM_THREADS`` for it: several engines sharing a few cores run faster
    with one torch thread each.
    """

    def __init__(
        self,
        url: str,
        run: str,
        model: Path,
        worker_id: str,
        *args: str,
        threads: int | None = 1,
    ) -> None:
        self.worker_id = worker_id
        command = [sys.executable, "-m", "seamlessflow.cli", "worker", "--nats", url]
        command += ["--run", run, "--model", str(model), "--worker-id", worker_id, *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
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

    def wait_ready(self, timeout: float = 120.0) -> "WorkerProcess":
        """Return once the worker serves; stop it and raise if it exits or is not serving in
        ``timeout`` seconds."""
        if self._ready.wait(timeout) and self.metrics_url:
            return self
        self.stop()
        raise WorkerProcessError(
            f"worker {self.worker_id} did not start within {timeout:g}s:\n{''.join(self.output)}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGTERM: a clean stop) and wait; SIGKILL and raise past ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise WorkerProcessError(
                f"worker {self.worker_id} did not stop within {timeout:g}s:\n{''.join(self.output)}"
            ) from None
