"""Publishing weight versions: fast on this host, off the training path for the others.

Per version, on the training path (the weights are read straight from the model, no copy of
them made, so before the next optimizer step changes them):

- with ``local_weights_dir`` (tmpfs, ``/dev/shm`` by default): write the safetensors file there
  and announce it with ``host`` set (``broker.weights.announce_local``); rollout workers on this
  host load it in place, no fetch, no checksum;
- without: serialise the blob in memory;
- where the trainer shares its process with an engine that takes tensors (a colocated worker's
  hf engine: ``InProcess``) and no other worker that may load a version is in the registry
  (``ServingWatch.engines``), hand the version to that engine instead: it loads in the step,
  and nothing is written; the version is announced as held in this process
  (``broker.weights.announce_held``). Writing SmolLM2's 540 MB to tmpfs was 0.2-0.3 s of each
  step. Once another worker appears (or the trainer stops), ``run`` writes the held version's
  file under the step lock (the model cannot change meanwhile), if no newer one was made, and
  announces it; from the next version on, every version gets its file in the step again, and
  every worker loads it from there (a handover beside the write did not pay:
  ``docs/performance.md``).

Off the training path, a background task (``run``) then stores the newest version not yet stored
in the object store (or ``weights_dir``) and announces it for every host
(``broker.weights.publish_weights``), trying again through a broker outage. A version superseded
before its upload started is skipped: workers elsewhere only ever need the newest one. With a
host-local copy, a version is stored only once some live rollout worker needs it
(``store_needed``): one on another node, one on this node still without it ``LOCAL_GRACE_S``
after its announcement (it cannot see the copy; from then on it counts as elsewhere), or the
trainer stopping (the last version is stored for whoever starts next). On one host every worker
loads the copy in place and nothing is stored meanwhile: storing SmolLM2's 540 MB (read, hashed,
sent through the broker, written by it) took two shared cores from every step and rollout.
"""

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import Histogram
from safetensors.torch import save, save_file

from broker.exceptions import RetryStoppedError
from broker.registry import node_name
from broker.retry import retry
from broker.subjects import RunNames
from broker.weights import (
    LOCAL_BLOB,
    announce_held,
    announce_local,
    latest_weights,
    local_folder,
    newest_local,
    publish_weights,
    run_instance,
)
from broker.worker_messages import WorkerRegistered
from common.log import kv
from trainer.config import TrainerConfig
from trainer.metrics import WEIGHTS_HELD
from trainer.watch import ServingWatch

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, torch.Tensor]]
IN_MODEL = None
"""A queued version's payload while only the model holds it (``announce_held``)."""


@dataclass(frozen=True)
class InProcess:
    """The rollout worker in the trainer's own process, if its engine takes tensors:
    ``take(version, tensors)`` loads them into it, True once it serves that version."""

    worker_id: str
    take: Callable[[int, dict[str, torch.Tensor]], Awaitable[bool]]


@dataclass(frozen=True)
class Model:
    """What the publisher reads the model by, outside a step: the trainer's step lock (held
    for each step, so the weights cannot change under it) and its current version."""

    stepping: asyncio.Lock
    version: Callable[[], int]


@dataclass(frozen=True)
class Held:
    """What holding versions in this process takes: the engine that takes them and the model
    they are read from."""

    engine: InProcess
    model: Model


LOCAL_GRACE_S = 10.0
"""How long a rollout worker on this node may take to load a host-local copy before the version
is stored for it."""


def store_needed(
    version: int,
    workers: Iterable[WorkerRegistered],
    node: str,
    waited_s: float,
    elsewhere: set[str],
) -> bool:
    """Whether a live rollout worker in ``workers`` needs ``version`` from the store: one behind
    it on another node than ``node``, or in ``elsewhere`` (seen not to read this node's copies),
    or still behind ``LOCAL_GRACE_S`` after the announcement (added to ``elsewhere``)."""
    behind = [w for w in workers if w.version is None or w.version < version]
    if waited_s >= LOCAL_GRACE_S:
        elsewhere.update(w.worker_id for w in behind)
    return any(w.host != node or w.worker_id in elsewhere for w in behind)


class WeightPublisher:
    """See the module docstring. ``publish`` from the step; ``run`` as a task until ``close``."""

    def __init__(
        self,
        js,
        names: RunNames,
        config: TrainerConfig,
        seconds: Histogram,
        watch: ServingWatch,
        held: Held | None = None,
    ) -> None:
        """``watch``: the registry's live workers; ``held``: the engine in this process, if it
        takes tensors, and the model (the module docstring)."""
        self._js = js
        self._held = held
        self._state: StateFn | None = None  # how the newest version's weights are read
        self._names = names
        self._config = config
        self._watch = watch
        self._elsewhere: set[str] = set()  # workers on this node that did not load its copies
        self.stop = asyncio.Event()  # once set, retries through an outage give up
        self._seconds = seconds  # labelled by path: local | store
        self._pending: tuple[int, Path | bytes | None, float] | None = None  # newest not stored
        self._wake = asyncio.Event()
        self._closing = False
        self._root: Path | None = None  # the host-local copies' folder (``_local_root``)

    async def announced(self) -> tuple[int, bool]:
        """The newest version announced for the run (on the weights stream or, with
        ``local_weights``, on this host only), and whether the stream's newest announcement is of
        a host-local copy only."""
        latest = await retry(lambda: latest_weights(self._js, self._names), what="weights_latest")
        published = latest.version if latest else 0
        if self._config.local_weights:  # a newer version may have been announced here only
            newest = await asyncio.to_thread(newest_local, await self._local_root(), self._names)
            published = max(published, newest)
        return published, latest is not None and latest.host is not None

    async def publish(self, version: int, state: StateFn) -> bool:
        """Where the engine of this process is the only one, hand ``version`` over to it and
        announce it held; else (or if it did not take it) write its weights out of the model
        and announce the host-local copy, if any; queue the upload. False if stopped before the
        announcement (the broker away)."""
        started = time.monotonic()
        self._state = state
        if self._held is not None and self._config.local_weights and not self._others(version):
            tensors = await asyncio.to_thread(state)
            if await self._held.engine.take(version, tensors):
                published = await self._announce_held(version, started)
            else:  # its engine asleep (lending memory): the file, loaded at the reclaim
                published = await self._publish(version, lambda: tensors, started)
        else:
            published = await self._publish(version, state, started)
        if published and self._config.local_weights:  # what the step waited for
            self._seconds.labels("local").observe(time.monotonic() - started)
        return published

    def _others(self, version: int) -> bool:
        """Whether a live worker that may load a version (``ServingWatch.engines``), other than
        the one in this process, is behind ``version``: it can load only a file."""
        own = self._held.engine.worker_id if self._held is not None else None
        return any(
            w.worker_id != own and (w.version is None or w.version < version)
            for w in self._watch.engines().values()
        )

    async def _announce_held(self, version: int, started: float) -> bool:
        try:
            await retry(
                lambda: announce_held(self._js, self._names, version, self._held.engine.worker_id),
                what="weights_announce_held",
                stop=self.stop,
            )
        except RetryStoppedError as exc:
            self._unpublished(version, exc)
            return False
        WEIGHTS_HELD.inc()
        self._pending = (version, IN_MODEL, started)
        self._wake.set()
        return True

    async def _write_held(self, version: int, started: float) -> None:
        """The held ``version``'s file, written and announced (``_publish``) under the step lock,
        if the model still holds it and no newer version was queued meanwhile."""
        assert self._held is not None and self._state is not None
        model = self._held.model
        async with model.stepping:
            if self._pending != (version, IN_MODEL, started):
                return  # a newer version was queued: that one next
            if model.version() != version or not await self._publish(version, self._state, started):
                self._pending = None  # the model moved on (a resume), or stopped

    async def _publish(self, version: int, state: StateFn, started: float) -> bool:
        if not self._config.local_weights:
            payload: Path | bytes = await asyncio.to_thread(lambda: save(state()))
        else:
            try:
                folder = local_folder(await self._local_root(), self._names, version)
                await asyncio.to_thread(lambda: write_folder(state(), folder))
                await retry(
                    lambda: announce_local(self._js, self._names, version, folder),
                    what="weights_announce_local",
                    stop=self.stop,
                )
            except RetryStoppedError as exc:
                self._unpublished(version, exc)
                return False
            payload = folder / LOCAL_BLOB
        self._pending = (version, payload, started)
        self._wake.set()
        return True

    async def run(self) -> None:
        """Upload the newest queued version once it is needed, one at a time, until ``close``
        has been called and nothing is queued."""
        node = node_name()
        while True:
            if self._pending is None:
                if self._closing:
                    await asyncio.to_thread(self._remove_local)
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            version, payload, started = self._pending
            if payload is IN_MODEL:  # held in this process only: a file once another needs one
                if self._closing or self._others(version):
                    await self._write_held(version, started)
                else:
                    await self._look_again()
                continue
            if isinstance(payload, Path) and not self._closing:  # a host-local copy
                waited = time.monotonic() - started
                live = self._watch.live().values()
                if not store_needed(version, live, node, waited, self._elsewhere):
                    await self._look_again()
                    continue
            self._pending = None
            await self._upload(version, payload, started)

    async def _look_again(self) -> None:
        """Until a newer version, close, or a second on."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), 1.0)

    def close(self) -> None:
        """Let ``run`` finish the upload queued last (cut short only if ``stop`` is set and the
        broker is away), delete the run's host-local copies, and end."""
        self._closing = True
        self._wake.set()

    async def _upload(self, version: int, payload: Path | bytes, started: float) -> None:
        if isinstance(payload, Path):
            try:
                blob = await asyncio.to_thread(payload.read_bytes)
            except FileNotFoundError:  # pruned: three newer versions were announced meanwhile
                log.info(kv("weights_upload_superseded", version=version))
                return
        else:
            blob = payload
        try:
            await retry(
                lambda: publish_weights(
                    self._js, self._names, version, blob, directory=self._config.weights_dir
                ),
                what="weights_publish",
                stop=self.stop,
            )
        except RetryStoppedError as exc:
            self._unpublished(version, exc)
            return
        self._seconds.labels("store").observe(time.monotonic() - started)
        log.info(kv("weights_published", version=version, bytes=len(blob)))

    async def _local_root(self) -> Path:
        """``local_weights_dir/<run instance>`` (``broker.weights.run_instance``): this run's
        copies apart from those of a run of the same name on another broker, or of an earlier
        one left behind (a trainer that resumes on the same broker finds its own)."""
        if self._root is None:
            instance = await retry(
                lambda: run_instance(self._js, self._names), what="weights_instance", stop=self.stop
            )
            self._root = self._config.local_weights_dir / instance
        return self._root

    def _remove_local(self) -> None:
        """The run's host-local copies take memory (tmpfs): gone when the trainer stops."""
        if self._root is not None:
            shutil.rmtree(self._root / self._names.run, ignore_errors=True)
            with contextlib.suppress(OSError):  # another run's copies may share the instance
                self._root.rmdir()

    def _unpublished(self, version: int, exc: Exception) -> None:
        """Stopped during an outage: the checkpoint has the version; ``Trainer.publish_if_missing``
        publishes it on the next start."""
        checkpoint = self._config.checkpoint_dir
        log.warning(kv("weights_unpublished", version=version, checkpoint=checkpoint, error=exc))


def write_folder(state: dict[str, torch.Tensor], folder: Path) -> None:
    """Write ``folder/model.safetensors`` whole or not at all (a sibling folder renamed in)."""
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    save_file(state, partial / LOCAL_BLOB)
    if folder.exists():  # a restart re-announcing its checkpoint's version
        shutil.rmtree(folder)
    partial.rename(folder)
