"""A rollout worker following the published weight versions.

Each ``WeightsPublished`` event pauses the engine at a token boundary, loads the new version and
resumes: in-flight requests continue on the new weights, and their chunks say so. A version is
loaded once (one whose blob or load fails is counted and the engine keeps the version it has;
a broker that cannot answer is waited for); one superseded while queued is skipped; another
host's in-memory copy waits for the object store's announcement. With ``weight_waves`` > 1 the
rollout workers load in waves, so not all capacity pauses at once. A load past
``weight_load_timeout_s`` quarantines the worker (routing stops, its generations continue
elsewhere) until it holds the newest version.

Where the worker stands in that rhythm (``WeightsState``: ready, waiting, loading; its wave;
quarantined) is written to its registry entry as it changes, for the scheduler and
``seamlessflow status``, and shown on ``/metrics``.
"""

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from broker import codec
from broker.exceptions import BrokerError, InvalidMessageError
from broker.messages import Role, WeightsPublished, WeightsState
from broker.registry import Registration, read_registry
from broker.retry import retry
from broker.subjects import RunNames
from broker.weights import fetch_weights_apart, latest_weights, local_copy
from common.log import kv
from rollout.engines import Engine, EngineError
from rollout.engines.base import TakesTensors
from rollout.metrics import (
    ENGINE_PAUSE,
    INTERRUPTIONS,
    QUARANTINED,
    QUARANTINES,
    VERSION,
    WAVE,
    WAVE_WAIT,
    WEIGHT_ERRORS,
    WEIGHT_LOAD,
    WEIGHTS_STATE,
)
from rollout.worker_config import WorkerConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Served(Protocol):
    """What weight loads need of the worker: whether it serves, and stopping or resuming that."""

    def serving(self) -> bool:
        """Consuming ``gen.req`` now (an idle worker's engine stays paused)."""
        ...

    def in_flight(self) -> int: ...

    def lent(self) -> bool:
        """Its engine sleeps (the device's memory lent to training): a version waits for the
        reclaim, which loads the newest."""
        ...

    async def quarantine(self) -> None:
        """Stop routing to the worker and abort what it has in flight."""
        ...

    async def rejoin(self) -> None:
        """Serve again, if the worker's role is rollout."""
        ...


class WeightFollower:
    """Loads the run's weight versions into ``engine``, one at a time, under ``lock`` (which the
    worker's role switches also take, so a switch never resumes a load in progress)."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        engine: Engine,
        config: WorkerConfig,
        worker: Served,
        lock: asyncio.Lock,
        *,
        nats_url: str,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self._config = config
        self._worker = worker
        self._lock = lock
        self._nats_url = nats_url  # weights are fetched on a connection of their own
        self._tried_version = -1
        self._registration: Registration | None = None  # told of each version once following
        self.quarantined = False
        self._state = WeightsState.READY
        self._wave: int | None = None

    async def load_latest(self) -> None:
        """Load the newest published version, if any: at start, before registering."""
        if (event := await latest_weights(self._js, self._names)) is not None:
            await self._load_or_count(event)
        VERSION.set(self._engine.version)

    async def follow(self, registration: Registration) -> Subscription:
        """Load every version published from now on, writing each to ``registration``."""
        self._registration = registration
        return await self._js.subscribe(
            self._names.weights,
            stream=self._names.weights_stream,
            cb=self._on_weights,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        )

    async def _on_weights(self, msg: Msg) -> None:
        try:
            event = codec.decode(WeightsPublished, msg.data)
        except InvalidMessageError as exc:
            WEIGHT_ERRORS.inc()
            log.error(kv("bad_weights_event", subject=msg.subject, error=exc.reason))
            return
        await self._load_or_count(event)

    async def _load_or_count(self, event: WeightsPublished) -> None:
        """Load ``event``'s version. While the broker cannot answer (a cut link, an R3 stream
        electing) the load waits for it, until it loads or a newer version supersedes it; a
        version that cannot be fetched or loaded for any other reason is logged and counted,
        and the engine keeps serving the version it has."""
        try:
            await retry(lambda: self._load(event), what="weights_load")
        except (BrokerError, EngineError, NatsError) as exc:
            self._tried_version = max(self._tried_version, event.version)  # not tried again
            WEIGHT_ERRORS.inc()
            log.error(kv("weights_load_failed", version=event.version, error=exc))

    def _deferred(self, version: int) -> bool:
        """Whether the worker is lent (its engine asleep): then nothing is fetched or loaded, and
        the reclaim loads the newest version."""
        if self._worker.lent():
            log.info(kv("weights_deferred", version=version))
            return True
        return False

    async def _newest(self, event: WeightsPublished) -> bool:
        """Whether ``event`` is newer than any version tried and not superseded."""
        if event.version <= max(self._engine.version, self._tried_version):
            return False
        latest = await latest_weights(self._js, self._names)
        if latest is not None and latest.version > event.version:
            # Superseded while queued (the trainer steps faster than this worker loads, and old
            # blobs are pruned): the newer event is next; load that one instead.
            log.info(kv("weights_superseded", version=event.version, latest=latest.version))
            return False
        return True

    async def take(self, version: int, tensors: "Mapping[str, torch.Tensor]") -> bool:
        """Load ``version`` from ``tensors`` held in this process (a colocated trainer's, handed
        over in its step while they cannot change), ahead of its announcement, which then finds
        it loaded: no file read. An engine that cannot take tensors (``TakesTensors``) or a lent
        worker's leaves it to the announcement. A load that fails is counted, as any. Whether
        the engine now serves ``version``."""
        engine = self._engine
        if not isinstance(engine, TakesTensors) or version <= engine.version:
            return engine.version == version
        started = time.monotonic()
        try:
            if await self._paused_load(version, lambda: engine.load_tensors(version, tensors)):
                self._loaded(version, started, started, "in_process")
        except EngineError as exc:
            WEIGHT_ERRORS.inc()
            log.error(kv("weights_load_failed", version=version, error=exc, path="in_process"))
        finally:
            VERSION.set(self._engine.version)
            await self._show(WeightsState.READY, version=self._engine.version)
        return engine.version == version

    async def _load(self, event: WeightsPublished) -> None:
        """Fetch and load ``event``'s version if it is newer than any tried before (a version
        that failed is not tried again). Called at start, then from the weights subscription,
        whose callbacks run one at a time: loads never overlap."""
        if not await self._newest(event) or self._deferred(event.version):
            return
        local = local_copy(event) if event.host is not None else None
        if event.host is not None and local is None:
            # another host's in-memory copy: this version's object-store announcement follows
            log.debug(kv("weights_not_local", version=event.version, host=event.host))
            return
        started = time.monotonic()
        await self._show(WeightsState.WAITING)
        try:
            await self._wait_for_wave(event.version)
            async with self._weights_folder(event, local) as folder:
                fetched = time.monotonic()
                load = partial(self._engine.load_weights, event.version, folder)
                loaded = await self._paused_load(event.version, load)
        finally:
            VERSION.set(self._engine.version)
            await self._show(WeightsState.READY, version=self._engine.version)
        if loaded:
            self._loaded(event.version, started, fetched, "local" if local else "store")

    async def _paused_load(self, version: int, load: Callable[[], Awaitable[None]]) -> bool:
        """``load`` with the engine paused, under the lock; False if the worker was lent or the
        version loaded (handed over) meanwhile."""
        try:
            async with self._lock:
                if self._deferred(version) or version <= self._engine.version:
                    return False  # lent while it fetched, or handed over meanwhile
                self._tried_version = version
                INTERRUPTIONS.labels("weight_update").inc(self._worker.in_flight())
                await self._show(WeightsState.LOADING)
                with ENGINE_PAUSE.labels("pause").time():
                    await self._engine.pause()
                try:
                    await self._load_within_deadline(version, load)
                finally:
                    if self._worker.serving():  # an idle worker's engine stays paused
                        with ENGINE_PAUSE.labels("resume").time():
                            await self._engine.resume()
        finally:
            await self._rejoin()
        return True

    def _loaded(self, version: int, started: float, fetched: float, path: str) -> None:
        seconds = time.monotonic() - started
        WEIGHT_LOAD.labels(path).observe(seconds)
        log.info(
            kv(
                "weights_loaded",
                version=version,
                seconds=round(seconds, 3),
                fetch_seconds=round(fetched - started, 3),
                path=path,
                in_flight=self._worker.in_flight(),
            )
        )

    @contextlib.asynccontextmanager
    async def _weights_folder(
        self, event: WeightsPublished, local: Path | None
    ) -> AsyncIterator[Path]:
        """A folder holding ``event``'s safetensors: the host-local copy itself, or the blob
        fetched from the store into a temporary folder."""
        if local is not None:
            yield local
            return
        # A broker that does not answer now (a 503 while an R3 stream elects, an outage) is
        # waited for: the version is not given up for it.
        blob = await retry(lambda: fetch_weights_apart(self._nats_url, event), what="weights_fetch")
        with tempfile.TemporaryDirectory(prefix="sf-weights-") as folder:
            await asyncio.to_thread((Path(folder) / "model.safetensors").write_bytes, blob)
            del blob
            yield Path(folder)

    async def _wait_for_wave(self, version: int) -> None:
        """With ``weight_waves`` > 1, wait (serving the old version) until every live rollout
        worker of an earlier wave serves ``version``, or ``wave_timeout_s``. Waves are the live
        rollout workers sorted by id, dealt round-robin; live: its entry written within three
        heartbeats, dated by the server (``read_registry``), never by the writer's clock."""
        waves = self._config.weight_waves
        if waves <= 1 or not self._worker.serving():  # an idle worker pauses nobody's capacity
            return
        me = self._config.worker_id
        started = time.monotonic()
        fresh_s = 3 * self._config.heartbeat_s
        while time.monotonic() - started < self._config.wave_timeout_s:
            live = {
                s.entry.worker_id: s.entry
                for s in await read_registry(self._js, self._names)
                if s.entry is not None
                and s.entry.role is Role.ROLLOUT
                and not s.entry.quarantined
                and s.age() < fresh_s
            }
            ids = sorted(live)
            if me not in ids:
                break
            wave = ids.index(me) % waves
            if wave != self._wave:
                self._wave = wave
                await self._show(WeightsState.WAITING)
            earlier = [live[w] for i, w in enumerate(ids) if i % waves < wave]
            if all((w.version if w.version is not None else -1) >= version for w in earlier):
                break
            await asyncio.sleep(0.1)
        WAVE_WAIT.observe(time.monotonic() - started)

    async def _load_within_deadline(
        self, version: int, load: Callable[[], Awaitable[None]]
    ) -> None:
        """Load ``version``; past ``weight_load_timeout_s``, quarantine this worker (stop routing
        to it, abort what it has in flight so the gateway continues it elsewhere) and wait for
        the load to end. The load itself is never cut short: that would leave mixed weights."""
        load = asyncio.ensure_future(load())
        done, _ = await asyncio.wait({load}, timeout=self._config.weight_load_timeout_s)
        if not done:
            QUARANTINES.inc()
            self.quarantined = True
            log.error(kv("weights_load_stuck", version=version, quarantined=True))
            await self._show(self._state)
            await self._worker.quarantine()
        await load

    async def _rejoin(self) -> None:
        """Leave quarantine once the newest published version has been tried (loaded, or
        failed and counted: then the worker serves the version it has, as any worker would)."""
        if not self.quarantined:
            return
        latest = await latest_weights(self._js, self._names)
        if latest is not None and latest.version > max(self._engine.version, self._tried_version):
            return  # that version's event is next: rejoin after it
        self.quarantined = False
        await self._show(self._state)
        await self._worker.rejoin()
        log.info(kv("worker_rejoined", version=self._engine.version))

    async def _show(self, state: WeightsState, **changes) -> None:
        """Say where this worker stands (``state``, its wave, whether quarantined, and
        ``changes``) on ``/metrics`` and in its registry entry at once, not at the next
        heartbeat. A write the broker cannot take now is logged: the entry keeps the change and
        the next heartbeat carries it, so a weight load never stops on it."""
        self._state = state
        for s in WeightsState:
            WEIGHTS_STATE.labels(s.value).set(s is state)
        QUARANTINED.set(self.quarantined)
        WAVE.set(self._wave or 0)
        if self._registration is None:  # loading before registering: the entry is made after
            return
        self._registration.note(
            weights=state, wave=self._wave, quarantined=self.quarantined, **changes
        )
        try:
            await self._registration.put()
        except NatsError as exc:
            log.warning(kv("weights_state_write_failed", state=state, error=exc))
