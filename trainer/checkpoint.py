"""Checkpoints: the backend's state, the weight version and the sample ids of recent steps, written
atomically; plus ``steps.jsonl``, one line per committed step naming the samples it trained and
those it dropped, with the reason (the audit trail a restart extends, never rewrites). A step
whose samples were all dropped trains nothing and makes no version: its line repeats the version
before it and has no ``trained`` sample.

Off the training path: the step takes a ``snapshot`` (a CPU copy of model and optimizer state,
in memory) and a ``CheckpointWriter`` writes it in its one background thread, then the steps log
lines it covers, in the order they were submitted; the trainer acknowledges those steps' samples
only once both are durable (``trainer.service``).

Layout of ``checkpoint_dir``: ``v<version>.pt`` files (the newest two kept), ``latest`` (the name
of the newest complete one, replaced atomically), ``steps.jsonl``.
"""

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.log import kv
from trainer.exceptions import CheckpointError

log = logging.getLogger(__name__)

LATEST = "latest"
STEPS_LOG = "steps.jsonl"
KEEP = 2


@dataclass(frozen=True)
class StepRecord:
    """The samples one committed step consumed (trained or dropped), by id."""

    version: int  # the version the step produced (the one before it if it trained nothing)
    sample_ids: tuple[str, ...]
    dropped: tuple[tuple[str, str], ...] = ()
    """``(sample_id, reason)`` of each consumed sample that was not trained."""

    @property
    def trained(self) -> tuple[str, ...]:
        dropped = {sid for sid, _ in self.dropped}
        return tuple(sid for sid in self.sample_ids if sid not in dropped)

    def line(self) -> str:
        """The record as one ``steps.jsonl`` line."""
        entry = {
            "version": self.version,
            "trained": list(self.trained),
            "dropped": dict(self.dropped),
            "sample_ids": list(self.sample_ids),
        }
        return json.dumps(entry) + "\n"

    @classmethod
    def from_line(cls, entry: dict[str, Any]) -> "StepRecord":
        return cls(
            entry["version"],
            tuple(entry["sample_ids"]),
            tuple(entry.get("dropped", {}).items()),  # lines from before drops were logged
        )


@dataclass(frozen=True)
class Checkpoint:
    version: int
    backend: dict[str, Any]
    recent: tuple[StepRecord, ...] = field(default_factory=tuple)

    def trained_ids(self) -> set[str]:
        return {sid for step in self.recent for sid in step.sample_ids}


def save(directory: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` atomically (temp file, fsync, rename, then the ``latest`` pointer) and
    remove all but the newest ``KEEP``."""
    name = f"v{checkpoint.version}.pt"
    payload = {
        "version": checkpoint.version,
        "backend": checkpoint.backend,
        "recent": [
            (s.version, list(s.sample_ids), [list(d) for d in s.dropped]) for s in checkpoint.recent
        ],
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _atomic(directory / name, lambda f: torch.save(payload, f))
        _atomic(directory / LATEST, lambda f: f.write(name.encode()))
        for old in sorted(directory.glob("v*.pt"), key=version_of)[:-KEEP]:
            old.unlink()
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {directory / name}: {exc}") from exc
    return directory / name


def latest_path(directory: Path) -> Path | None:
    """The newest complete checkpoint file in ``directory``, or None if there is none yet."""
    pointer = directory / LATEST
    return directory / pointer.read_text().strip() if pointer.exists() else None


def load_file(path: Path) -> Checkpoint:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        recent = tuple(
            StepRecord(step[0], tuple(step[1]), tuple(map(tuple, step[2] if len(step) > 2 else ())))
            for step in payload["recent"]
        )
        return Checkpoint(payload["version"], payload["backend"], recent)
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def append_steps(directory: Path, records: Iterable[StepRecord]) -> None:
    """Add ``records`` to the steps log, skipping those it already has (a restart re-adds the
    checkpoint's last steps in case the process died between the checkpoint and the log line)."""
    logged = {(r.version, r.sample_ids) for r in read_steps(directory)}
    lines = [r.line() for r in records if (r.version, r.sample_ids) not in logged]
    if lines:
        path = directory / STEPS_LOG
        if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            lines.insert(0, "\n")  # end a line torn by a crash; read_steps skips it
        with open(path, "a") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())


def read_steps(directory: Path) -> list[StepRecord]:
    """Every step in the log, oldest first (a torn last line from a crash is ignored)."""
    path = directory / STEPS_LOG
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        records.append(StepRecord.from_line(entry))
    return records


def version_of(path: Path) -> int:
    """The version of the checkpoint file ``path`` (``v<version>.pt``), without reading it."""
    return int(path.stem[1:])


def _yield_cpu() -> None:
    """The writer thread runs at the lowest CPU priority (nice 19, this thread only): it takes
    the cores the step and rollout leave idle instead of slowing them (on 2 cores a checkpoint
    write beside a SmolLM2 step slowed it by 1.3 s of 5 at the same priority)."""
    with contextlib.suppress(OSError):  # not permitted here: it writes at the same priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def snapshot(state: Any, into: Any = None) -> Any:
    """A CPU copy of ``state`` (dicts, lists and tuples of tensors and plain values) that later
    steps do not change. ``into``: an earlier snapshot of the same state, no longer read; its
    tensors of the same shape and dtype are copied into instead of allocated anew (a fresh
    1.6 GB allocation faults in every page, on the training path)."""
    if isinstance(state, torch.Tensor):
        fits = isinstance(into, torch.Tensor) and into.shape == state.shape
        if fits and into.dtype == state.dtype:
            return into.copy_(state.detach())
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        old = into if isinstance(into, dict) else {}
        return {k: snapshot(v, old.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        old = into if isinstance(into, type(state)) and len(into) == len(state) else ()
        copied = [snapshot(v, old[i] if old else None) for i, v in enumerate(state)]
        return type(state)(copied)
    return state  # numbers, strings, None: immutable


class CheckpointWriter:
    """Writes commits (a checkpoint and the steps log lines it makes durable, or lines alone) in
    one background thread, in the order submitted, each one's future done once it is durable.
    The caller keeps at most one checkpoint in flight (``checkpoint_idle``): a snapshot is only
    reused once it is written. ``close`` finishes what was submitted."""

    def __init__(self, directory: Path | None, seconds) -> None:
        self._directory = directory
        self._seconds = seconds  # a Histogram: each checkpoint's write
        self._thread = ThreadPoolExecutor(1, "checkpoint", initializer=_yield_cpu)
        self._pending: set[asyncio.Future[None]] = set()
        self._checkpoint: asyncio.Future[None] | None = None  # the last one with a checkpoint
        self.spare: Any = None  # the last written checkpoint's state, for ``snapshot(into=)``

    def submit(
        self, checkpoint: "Checkpoint | None", records: tuple[StepRecord, ...]
    ) -> asyncio.Future[None]:
        """Queue ``checkpoint`` (None: steps log lines only) and then ``records``' lines."""
        done = asyncio.wrap_future(self._thread.submit(self._write, checkpoint, records))
        self._pending.add(done)
        done.add_done_callback(self._pending.discard)
        if checkpoint is not None:
            self._checkpoint = done
        return done

    async def checkpoint_idle(self) -> Any:
        """Until the checkpoint in flight, if any, is written (its error is its future's); then
        the state of the last one written, free for ``snapshot(into=)``."""
        if self._checkpoint is not None:
            await asyncio.wait([self._checkpoint])
        return self.spare

    async def drain(self) -> None:
        """Until everything submitted is durable or has failed."""
        if self._pending:
            await asyncio.wait(set(self._pending))

    def close(self) -> None:
        """Finish what was submitted (blocking), then end the thread."""
        self._thread.shutdown(wait=True)

    def _write(self, checkpoint: "Checkpoint | None", records: tuple[StepRecord, ...]) -> None:
        if checkpoint is not None:
            started = time.monotonic()
            path = save(self._directory, checkpoint)
            spent = time.monotonic() - started
            self._seconds.observe(spent)
            self.spare = checkpoint.backend
            log.info(kv("checkpoint_written", version=checkpoint.version, path=path, seconds=spent))
        append_steps(self._directory, records)
