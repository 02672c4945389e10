"""Checkpoints: the backend's state, the weight version and the sample ids of recent steps, written
atomically after every step; plus ``steps.jsonl``, one line per committed step naming the samples
it trained and those it dropped, with the reason (the audit trail a restart extends, never
rewrites). A step whose samples were all dropped trains nothing and makes no version: its line
repeats the version before it and has no ``trained`` sample.

Layout of ``checkpoint_dir``: ``v<version>.pt`` files (the newest two kept), ``latest`` (the name
of the newest complete one, replaced atomically), ``steps.jsonl``.
"""

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.exceptions import CheckpointError

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
    directory.mkdir(parents=True, exist_ok=True)
    name = f"v{checkpoint.version}.pt"
    payload = {
        "version": checkpoint.version,
        "backend": checkpoint.backend,
        "recent": [
            (s.version, list(s.sample_ids), [list(d) for d in s.dropped]) for s in checkpoint.recent
        ],
    }
    try:
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
