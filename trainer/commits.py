"""The trainer's commit path, no NATS here: the steps since the last checkpoint made durable in
the background (``checkpoint.CheckpointWriter``), in the order checkpoint -> its steps log lines
-> the acks of their samples (``release``). A failed write hands the samples back (nak:
redelivered, trained again from the last durable checkpoint) and is kept in ``failed`` for the
trainer's loop to raise."""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from broker.ingress import HandBack
from common.log import kv
from trainer import checkpoint
from trainer.backends import TrainerBackend
from trainer.checkpoint import Checkpoint, CheckpointWriter, StepRecord
from trainer.config import TrainerConfig
from trainer.exceptions import TrainerError
from trainer.metrics import CHECKPOINT_SECONDS, CHECKPOINT_STALL_SECONDS

log = logging.getLogger(__name__)

Release = Callable[[list[str], BaseException | None], None]


class Commits:
    """``release(sample_ids, error)`` settles samples (acks them, or nak with ``error``);
    ``on_failure`` is called once a write has failed."""

    def __init__(
        self,
        config: TrainerConfig,
        backend: TrainerBackend,
        release: Release,
        on_failure: Callable[[], None],
        version: int,
    ) -> None:
        self._config = config
        self._backend = backend
        self._release = release
        self._on_failure = on_failure
        self.writer = CheckpointWriter(config.checkpoint_dir, CHECKPOINT_SECONDS)
        self.uncommitted: list[StepRecord] = []  # steps since the last commit
        self.failed: BaseException | None = None  # a background write's error
        self.trained_unacked = 0
        """Samples trained into a commit being written: acknowledged once it is durable."""
        self.on_trained_unacked: Callable[[int], None] = lambda n: None
        """Told ``trained_unacked`` each time it changes (the trainer's registry entry)."""
        self._last = (version, time.monotonic())  # the last checkpoint's version, and when

    def due(self, version: int) -> bool:
        """A checkpoint of ``version`` is due: ``checkpoint_every`` versions or
        ``checkpoint_interval_s`` seconds since the last one (or the trainer's start)."""
        last, at = self._last
        return (
            version - last >= self._config.checkpoint_every
            or time.monotonic() - at >= self._config.checkpoint_interval_s
        )

    async def commit(
        self,
        version: int,
        recent: list[StepRecord],
        release: Sequence[str] = (),
        checkpointed: bool = True,
    ) -> None:
        """Make the steps since the last commit durable in the background: a checkpoint of
        ``version`` (unless ``checkpointed`` is False: only dropped samples since), then their
        steps log lines; ``release`` those samples once both are (at once without a
        ``checkpoint_dir``)."""
        records, self.uncommitted = self.uncommitted, []
        if self._config.checkpoint_dir is None or not records:
            self._release(list(release), None)
            return
        ckpt = await self.checkpoint(version, recent) if checkpointed else None
        done = self.writer.submit(ckpt, tuple(records))
        self._count_unacked(len(release))
        done.add_done_callback(lambda f: self._committed(version, list(release), f))

    def _count_unacked(self, change: int) -> None:
        if change:
            self.trained_unacked += change
            self.on_trained_unacked(self.trained_unacked)

    async def checkpoint(self, version: int, recent: list[StepRecord]) -> Checkpoint:
        """The state of ``version`` copied into memory, once the previous checkpoint's write is
        over (at most one in flight; its memory is reused)."""
        started, spare = time.monotonic(), await self.writer.checkpoint_idle()
        backend = self._backend  # its state() may copy (off the loop, like the snapshot)
        state = await asyncio.to_thread(lambda: checkpoint.snapshot(backend.state(), spare))
        CHECKPOINT_STALL_SECONDS.observe(time.monotonic() - started)
        self._last = (version, time.monotonic())
        return Checkpoint(version, state, tuple(recent))

    def _committed(self, version: int, release: list[str], done: asyncio.Future[None]) -> None:
        failure = "cancelled" if done.cancelled() else done.exception()
        if failure is None:
            self._release(release, None)
        else:
            error = TrainerError(f"checkpoint failed: {failure}")
            if self.failed is None:
                self.failed = error
                log.error(kv("checkpoint_failed", version=version, error=failure))
            self._on_failure()
            self._release(release, HandBack(str(error)))
        self._count_unacked(-len(release))
