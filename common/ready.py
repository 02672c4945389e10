"""How a long-running process says it is serving.

It prints a line for people (``<what> ready: key=value ... metrics=<url>``) and, when started
by a SeamlessFlow launcher, writes one JSON object to the pipe whose file descriptor the
launcher put in ``$SEAMLESSFLOW_READY_FD``, and closes it: ``{"process": ..., "metrics_url":
..., ...}``. The launcher reads that pipe, never the output, so no log line can be taken for
readiness.
"""

import json
import os

READY_FD = "SEAMLESSFLOW_READY_FD"
"""The environment variable holding the handshake pipe's file descriptor."""

_fd: int | None = None


def claim_handshake() -> None:
    """Take the pipe from the environment, at start, so the processes this one starts neither
    inherit it nor see its number."""
    global _fd
    fd = os.environ.pop(READY_FD, None)
    if fd is not None:
        _fd = int(fd)
        os.set_inheritable(_fd, False)


def announce_ready(process: str, metrics_url: str, **fields: object) -> None:
    """Print the ready line and write the handshake (once: the pipe is closed after it)."""
    global _fd
    shown = [f"{k}={v}" for k, v in fields.items()] + [f"metrics={metrics_url}"]
    print(f"{process} ready: {' '.join(shown)}", flush=True)
    if _fd is None:
        return
    handshake = {"process": process, "metrics_url": metrics_url, **fields}
    with os.fdopen(_fd, "w") as pipe:
        pipe.write(json.dumps(handshake, default=str) + "\n")
    _fd = None
