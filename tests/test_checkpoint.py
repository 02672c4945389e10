"""Checkpoints off the training path (``trainer.checkpoint``): the in-memory snapshot of a real
model's state and AdamW state, written by the background writer while training goes on, loads
back equal to the state it copied; the writer keeps the order it was given (checkpoint, then
its steps log lines); and a trainer whose checkpoint cannot be written stops with that error,
handing its samples back unacknowledged. The kill -9 resume is in ``test_trainer``."""

import asyncio
import copy

import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram

from broker.subjects import Durable
from tests.support import serving_trainer
from tests.test_trainer import _consumer_settled, dp_items, group, publish
from trainer import checkpoint
from trainer.checkpoint import Checkpoint, CheckpointWriter, StepRecord
from trainer.config import TrainerConfig
from trainer.exceptions import TrainerError

CONFIG = TrainerConfig(lr=1e-2, max_staleness=100)


def _seconds() -> Histogram:
    return Histogram("t_checkpoint_seconds", "test", registry=CollectorRegistry())


def _tensors(state) -> list[torch.Tensor]:
    """Every tensor of a nested state, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _equal(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def _step(backend) -> None:
    from trainer.step import train_step

    train_step(backend, dp_items(), 0, CONFIG)


async def test_a_background_checkpoint_equals_its_snapshot_though_training_went_on(
    tiny_model_dir, tmp_path
):
    from trainer.backends import build_backend

    backend = build_backend(tiny_model_dir, CONFIG)
    _step(backend)  # AdamW has state now: moments and step counts
    taken = copy.deepcopy(backend.state())
    shot = checkpoint.snapshot(backend.state())
    assert _equal(shot, taken)
    writer = CheckpointWriter(tmp_path, _seconds())
    record = StepRecord(1, ("a", "b"))
    written = writer.submit(Checkpoint(1, shot, (record,)), (record,))
    _step(backend)  # training goes on while (or before) the writer writes
    _step(backend)
    await written
    assert not _equal(backend.state(), taken)  # the steps moved the live state
    loaded = checkpoint.load_file(checkpoint.latest_path(tmp_path))
    assert loaded.version == 1 and _equal(loaded.backend, taken)
    assert [(r.version, r.sample_ids) for r in checkpoint.read_steps(tmp_path)] == [(1, ("a", "b"))]
    # The next snapshot reuses the written one's memory; what is on disk does not change.
    assert writer.spare is shot
    now = copy.deepcopy(backend.state())
    again = checkpoint.snapshot(backend.state(), writer.spare)
    assert again["model"] is not backend.state()["model"]
    first = next(iter(shot["model"].values()))
    assert next(iter(again["model"].values())).data_ptr() == first.data_ptr()  # reused
    assert _equal(again, now)
    # Loaded into a fresh backend, the file resumes it exactly where the snapshot was.
    fresh = build_backend(tiny_model_dir, CONFIG)
    fresh.load_state(checkpoint.load_file(tmp_path / "v1.pt").backend)
    assert _equal(fresh.state(), taken)
    writer.close()


async def test_the_writer_keeps_the_order_it_was_given(tiny_model_dir, tmp_path):
    """Log-only commits queued behind a checkpoint land after it, and lines in submit order."""
    from trainer.backends import build_backend

    backend = build_backend(tiny_model_dir, CONFIG)
    writer = CheckpointWriter(tmp_path, _seconds())
    steps = [StepRecord(v, (f"s{v}",)) for v in (1, 2, 3)]
    shot = checkpoint.snapshot(backend.state())
    done = [
        writer.submit(Checkpoint(1, shot, tuple(steps[:1])), tuple(steps[:1])),
        writer.submit(None, (StepRecord(1, ("d1",), (("d1", "stale"),)),)),
        writer.submit(None, tuple(steps[1:])),
    ]
    await writer.drain()
    assert all(d.done() and d.exception() is None for d in done)
    assert [r.sample_ids for r in checkpoint.read_steps(tmp_path)] == [
        ("s1",), ("d1",), ("s2",), ("s3",)
    ]  # fmt: skip
    writer.close()


async def test_a_checkpoint_is_due_every_few_versions_or_once_its_interval_has_passed(
    tiny_model_dir, tmp_path
):
    """``Commits.due``: ``checkpoint_every`` versions or ``checkpoint_interval_s`` seconds since
    the last checkpoint (or the trainer's start at its version), whichever comes first; an
    interval of 0 checkpoints every version."""
    from trainer.backends import build_backend
    from trainer.commits import Commits

    backend = build_backend(tiny_model_dir, CONFIG)
    config = CONFIG.model_copy(
        update={"checkpoint_dir": tmp_path, "checkpoint_every": 3, "checkpoint_interval_s": 2.0}
    )
    commits = Commits(config, backend, lambda ids, error: None, lambda: None, version=5)
    assert [commits.due(v) for v in (6, 7, 8)] == [False, False, True]  # 3 versions on
    await commits.checkpoint(7, [])  # counts start again from v7, now
    assert [commits.due(v) for v in (8, 9, 10)] == [False, False, True]
    await asyncio.sleep(2.0)
    assert commits.due(8)  # its interval has passed
    commits.writer.close()
    every = config.model_copy(update={"checkpoint_interval_s": 0.0})
    assert Commits(every, backend, lambda ids, error: None, lambda: None, version=5).due(6)


async def test_samples_wait_for_their_checkpoint_counted_as_trained(tiny_model_dir, tmp_path):
    """``Commits.trained_unacked``: a step's samples are counted from its commit until their
    checkpoint is durable and they are acknowledged (what the trainer's registry entry tells
    admission), and told each time the count changes."""
    from trainer.backends import build_backend
    from trainer.commits import Commits

    backend = build_backend(tiny_model_dir, CONFIG)
    config = CONFIG.model_copy(update={"checkpoint_dir": tmp_path})
    acked: list[str] = []
    told: list[int] = []
    commits = Commits(config, backend, lambda ids, error: acked.extend(ids), lambda: None, 5)
    commits.on_trained_unacked = told.append
    commits.uncommitted.append(StepRecord(6, ("s1", "s2"), ()))
    await commits.commit(6, [], ["s1", "s2"])
    assert commits.trained_unacked == 2 and told == [2] and acked == []  # being written
    await commits.writer.drain()
    await asyncio.sleep(0)  # the write's done callback
    assert acked == ["s1", "s2"] and commits.trained_unacked == 0 and told == [2, 0]
    commits.writer.close()


@pytest.mark.newest_nats
async def test_a_checkpoint_that_cannot_be_written_stops_the_trainer_and_acks_nothing(
    broker, js, names, tiny_model_dir, tmp_path
):
    """The checkpoint folder's parent is a file: the background write fails; the trainer stops
    with that error and the step's samples are handed back, not acknowledged."""
    (tmp_path / "file").write_text("not a folder")
    config = TrainerConfig(
        lr=1e-3,
        groups_per_step=1,
        max_staleness=100,
        checkpoint_dir=tmp_path / "file" / "ckpt",
        checkpoint_every=1,
        worker_id="trainer-f",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    serving = await serving_trainer(broker.url, js, names, config, tiny_model_dir, stop)
    await publish(js, names, *group("a", 2))
    with pytest.raises(TrainerError, match="checkpoint failed"):
        await asyncio.wait_for(serving, 60)
    info = await js.consumer_info(names.samples_stream, Durable.TRAINER)
    assert info.delivered.stream_seq == 2  # both were delivered ...
    assert info.ack_floor.stream_seq == 0  # ... and neither acknowledged
    assert not await _consumer_settled(js, names)
