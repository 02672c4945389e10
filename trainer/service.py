"""The trainer as a service: samples from NATS into steps, each step checkpointed, acknowledged
and published as a new weight version.

Per sample (``Ingress`` handler): skip-and-ack one already trained (redelivered after a restart),
else hold it in the ``Batcher`` and wait, un-acked (the ingress keeps it in progress), until the
step that used it is committed. Per step (``Trainer.run``):

1. in drop mode, wait (bounded) for an earlier admitted task's group the step would put past the
   staleness bound (``trainer.waits.OrderWait``, ``trainer.order``); take the ``groups_per_step``
   complete groups with the oldest tokens; advantages, staleness bound;
2. train on every rank (off the event loop); with ``overlap``, a step computed ahead a group at
   a time instead (``trainer.ahead``);
3. every ``checkpoint_every`` versions or ``checkpoint_interval_s`` seconds, whichever comes
   first (and at stop), commit (``trainer.commits``): a snapshot
   in memory, written in the background with the steps log; this step's samples are acked once
   both are durable, while training goes on. Steps between are acked at once (a crash loses
   them);
4. publish version v+1 (``trainer.publisher``: a host-local copy in the step, the object store
   in the background), not waiting for its checkpoint; time until every worker serves it.

A version may be announced before its checkpoint is durable: after a crash the stream is ahead
of the checkpoint (by less than ``2 * checkpoint_every`` versions) and the restart goes on after
it (``publish_if_missing``), the lost step's samples redelivered and trained under a new version.

NATS errors on the way are a broker outage, not a failed step: the weights of a version are
kept and published, tried again until the broker is back (de-duplicated per version); a trainer
stopped before that leaves the version to its checkpoint, published on the next start. On
shutdown the first error is the one raised; later ones are logged.

The trainer holds a role (``broker.roles``): it steps only as ``train``; asked to take another
(its worker lent to rollout, or idle), it finishes the step in progress and waits, still taking
and holding samples, until it is ``train`` again. The process around it: ``trainer.serve``.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from broker.config import ProvisionConfig
from broker.exceptions import InvalidMessageError
from broker.ingress import Delivery, HandBack, Ingress
from broker.messages import Role, SampleReady
from broker.provision import durable_info
from broker.roles import RoleHolder
from broker.subjects import Durable, RunNames
from common.log import kv
from trainer import checkpoint
from trainer.ahead import AheadSteps
from trainer.batcher import Batcher, Outcome, StepAhead, TrainItem, plan_step
from trainer.checkpoint import Checkpoint, StepRecord
from trainer.commits import Commits
from trainer.config import TrainerConfig
from trainer.exceptions import BatchError, GroupBrokenError, TrainerError
from trainer.metrics import (
    GROUPS_EXPIRED,
    HELD,
    INVALID,
    PUBLISH_SECONDS,
    SAMPLES,
    STEP_SECONDS,
    VERSION,
    report_plan,
    report_step,
)
from trainer.order import AdmissionOrder
from trainer.publisher import Held, InProcess, Model, WeightPublisher
from trainer.ranks import RankGroup
from trainer.step import StepStats
from trainer.waits import OrderWait, wait_first
from trainer.watch import ServingWatch

log = logging.getLogger(__name__)

T = TypeVar("T")
LENT_CHECK_S = 5.0
"""While lent, how often the trainer gives up the earlier tasks it waited for too long (its
registry entry keeps the worker lent for them until then)."""


class Trainer(AheadSteps):
    """Rank 0's loop; see the module docstring."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        config: TrainerConfig,
        ranks: RankGroup,
        watch: ServingWatch,
        start: Checkpoint | None,
        grouped: bool = False,
        in_process: InProcess | None = None,
    ) -> None:
        """``grouped``: a ``trainer.group.GroupLink`` drives this trainer: it takes samples and
        steps only once the link makes it the group's rank 0 and forms the group (and publishes
        then); otherwise it does both from the start. ``in_process``: ``WeightPublisher``'s."""
        self._grouped = grouped
        self._js = js
        self._names = names
        self._config = config
        self._ranks = ranks
        self._watch = watch
        self.version = start.version if start else 0
        self._recent: list[StepRecord] = list(start.recent) if start else []
        self._trained = start.trained_ids() if start else set()
        self._batcher = self._new_batcher()
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._order_wait = OrderWait(config, self._wake)
        self._stopping = False
        self._may_step = asyncio.Event()  # set while the trainer holds the train role
        self._may_step.set()
        self._stepping = asyncio.Lock()
        self._roles: RoleHolder | None = None  # set by serve: busy time, the entry's version
        held = Held(in_process, Model(self._stepping, lambda: self.version)) if in_process else None
        self._publisher = WeightPublisher(js, names, config, PUBLISH_SECONDS, watch, held)
        self._commits = Commits(
            config, ranks.backend, self._release, self._write_failed, self.version
        )
        # The trainer group (``trainer.group``): only its rank 0 takes samples (``_leading``),
        # steps only while the group is formed (``_formed``), and tells a failed collective
        # (``broken``). A trainer outside any group leads and is formed.
        self._leading = asyncio.Event()
        self._formed = asyncio.Event()
        if not grouped:
            self._leading.set()
            self._formed.set()
        self.broken = asyncio.Event()
        self._ingress_stop = asyncio.Event()
        self._provision: ProvisionConfig | None = None
        self._formation = 0  # counts formations of the trainer group
        self._ahead = StepAhead(0)  # with ``overlap``: the step being computed

    # -- samples ----------------------------------------------------------------------------
    def _new_batcher(self) -> Batcher:
        return Batcher(AdmissionOrder(self._config.order_wait_s, lambda: self.version == 0))

    async def on_sample(self, sample: SampleReady, delivery: Delivery) -> None:
        """Ingress handler: returns (-> ack) once the step that consumed the sample is committed."""
        if self._stopping:  # after the hand-back: nobody would release it
            raise HandBack("trainer stopping")
        if not self._leading.is_set():  # another member of the trainer group takes samples
            raise HandBack("not the trainer group's rank 0")
        # 1. Trained and settled before this (re)delivery: acknowledge it again, train nothing.
        future = self._waiting.get(sample.sample_id)
        if future is None and sample.sample_id in self._trained:
            SAMPLES.labels(Outcome.DUPLICATE.value).inc()
            log.info(kv("sample_duplicate", sample=sample.sample_id, seq=delivery.stream_seq))
            return
        # 2. Held already (while its group fills or its checkpoint is written): share the first
        # delivery's outcome.
        if future is None:
            try:
                self._batcher.add(sample)
            except BatchError as exc:
                INVALID.inc()
                raise InvalidMessageError(str(exc)) from exc  # dead-lettered with the reason
            future = self._waiting[sample.sample_id] = asyncio.get_running_loop().create_future()
            HELD.inc()
            self._order_wait.refresh(self._batcher, self.version, self._complete)
            self._wake.set()
        # 3. Wait for the commit (the ingress keeps the message in progress meanwhile); shielded,
        # so that a cancelled handler leaves the future to ``_release``.
        await asyncio.shield(future)

    def _release(self, sample_ids: list[str], error: BaseException | None = None) -> None:
        for sid in sample_ids:
            future = self._waiting.pop(sid, None)
            if future is None or future.done():
                continue
            HELD.dec()
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    # -- the trainer group -------------------------------------------------------------------
    async def lead(self, on: bool) -> None:
        """Take samples (``on``: this trainer is the group's rank 0) or stop taking them: then
        hand back every held sample (nak: rank 0 takes it) and stop consuming."""
        if on == self._leading.is_set():
            return
        if on:
            self._leading.set()
            return
        self._leading.clear()
        self._ingress_stop.set()  # fetch no more: one fetched now would be handed back (``serve``)
        async with self._stepping:  # a step in progress commits what it took
            # its checkpoint durable: the next rank 0 resumes from it
            await self._commits.writer.drain()
            self._release(list(self._waiting), HandBack("not the trainer group's rank 0"))
            self._batcher = self._new_batcher()
            self._ahead = self._afresh()
            await asyncio.to_thread(self._ranks.discard)

    def formed(self, on: bool) -> None:
        """Whether the trainer group is formed: steps wait while it is not."""
        if on:
            self._formation += not self._formed.is_set()
            self.broken.clear()
            self._formed.set()
        else:
            self._formed.clear()

    @property
    def stepping(self) -> asyncio.Lock:
        """Held for each step: the group re-forms between steps, never during one."""
        return self._stepping

    async def resume(self) -> None:
        """Becoming rank 0: carry on from the newest checkpoint if it is ahead of this trainer
        (the previous rank 0 committed it), then publish what it left unpublished."""
        directory = self._config.checkpoint_dir
        path = checkpoint.latest_path(directory) if directory is not None else None
        if path is not None and checkpoint.version_of(path) > self.version:
            start = await asyncio.to_thread(checkpoint.load_file, path)
            await asyncio.to_thread(self._ranks.backend.load_state, start.backend)
            self.version = start.version
            self._recent = list(start.recent)
            self._trained = start.trained_ids()
            # The previous rank 0 may have died between the checkpoint and its steps log line.
            await asyncio.to_thread(checkpoint.append_steps, directory, start.recent)
            log.info(kv("trainer_resumed", version=start.version, path=path))
        await self.publish_if_missing()

    async def _consume(self, stop: asyncio.Event) -> None:
        """Consume samples while leading, until ``stop``."""
        while not stop.is_set():
            if not self._leading.is_set():
                await wait_first(self._leading.wait(), stop.wait())
                continue
            self._ingress_stop = asyncio.Event()
            await self._samples(self._provision).run(self._ingress_stop)

    # -- steps ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Step whenever enough groups are complete, until ``stop``; then hand every held
        sample back (nak: another trainer run takes it)."""
        timeout = self._config.group_timeout_s
        self._publisher.stop = stop
        try:
            while not stop.is_set():
                if self._commits.failed is not None:
                    raise self._commits.failed
                if expired := self._batcher.expire(timeout):
                    GROUPS_EXPIRED.inc(expired)
                    log.warning(kv("groups_expired", groups=expired, after_s=timeout))
                if not self._may_step.is_set():  # lent or idle: wait to be given the role back
                    await wait_first(self._may_step.wait(), stop.wait(), timeout=LENT_CHECK_S)
                    # a task given up while lent?
                    self._order_wait.refresh(self._batcher, self.version, self._complete)
                    continue
                if not self._formed.is_set():  # the trainer group is (re-)forming
                    await wait_first(self._formed.wait(), stop.wait())
                    continue
                if self._config.overlap:
                    if not await self._ahead_turn(stop):
                        await self._sleep(stop)
                    continue
                if await self._order_wait.wait(self._batcher, self.version, stop, self._complete):
                    continue
                groups = self._batcher.take(self._config.groups_per_step)
                if groups is None:
                    await self._sleep(stop)
                    continue
                async with self._busy():
                    await self._step(groups)
            # stopped: the steps since the last checkpoint are kept
            await self._commits.commit(self.version, self._recent)
        finally:
            self._stopping = True
            await self._commits.writer.drain()  # writes in flight are finished, never cut
            self._release(list(self._waiting), HandBack("trainer stopping"))
        if self._commits.failed is not None:
            raise self._commits.failed

    async def _sleep(self, stop: asyncio.Event) -> None:
        """Until a sample comes (or a while: groups expire) or ``stop``."""
        self._wake.clear()
        timeout = min(self._config.group_timeout_s, 5.0)
        await wait_first(self._wake.wait(), stop.wait(), timeout=timeout)

    @contextlib.asynccontextmanager
    async def _busy(self) -> AsyncIterator[None]:
        """Held while training: the group re-forms and the role changes only between."""
        async with self._stepping:
            if self._roles is not None:
                self._roles.set_busy(True)
            try:
                yield
            finally:
                if self._roles is not None:
                    self._roles.set_busy(False)

    async def take(self, role: Role) -> None:
        """``RoleHolder``'s switch: step as ``train``; otherwise finish the step in progress and
        hold off (samples keep being taken and held)."""
        if role is Role.TRAIN:
            self._ranks.training.set()  # a follower member trains rank 0's steps again
            self._may_step.set()
            return
        self._ranks.training.clear()
        self._may_step.clear()
        async with self._stepping:  # the step in progress, if any, has committed
            pass

    def _plan(
        self, groups: list[list[SampleReady]]
    ) -> tuple[list[TrainItem], tuple[tuple[str, str], ...]]:
        """Advantages and the staleness bound (``plan_step``), counted; the items to train and
        the samples dropped."""
        items, outcomes, lags = plan_step(groups, self.version, self._config)
        return items, report_plan(groups, outcomes, lags, self.version, self._config)

    async def _step(self, groups: list[list[SampleReady]]) -> None:
        consumed = [s.sample_id for g in groups for s in g]
        items, dropped = self._plan(groups)
        if not items:
            await self._skip(consumed, dropped)
        elif done := await self._train(groups, lambda: self._ranks.step(items, self.version)):
            await self._settle(consumed, dropped, items, *done)

    async def _skip(self, consumed: list[str], dropped: tuple[tuple[str, str], ...]) -> None:
        """Everything was dropped: nothing to train, nothing to publish; logged, acked."""
        self._record(StepRecord(self.version, tuple(consumed), dropped))
        if len(self._commits.uncommitted) == 1:  # no trained step waits for a checkpoint
            commits = self._commits
            await commits.commit(self.version, self._recent, consumed, checkpointed=False)
        else:
            self._release(consumed)
        log.warning(kv("step_skipped", samples=len(consumed), reason="all dropped"))

    async def _train(
        self, groups: list[list[SampleReady]], run: Callable[[], T]
    ) -> tuple[T, float] | None:
        """``run`` on every rank, off the loop: what it returned and its seconds. A member lost
        mid-way (``GroupBrokenError``): nothing was committed or acknowledged, the weights are
        as the last step left them, and ``groups`` go back to the batcher for the re-formed
        group; None."""
        started = time.monotonic()
        try:
            result = await asyncio.to_thread(run)
        except GroupBrokenError as exc:
            self._batcher.restore(groups)
            self._formed.clear()
            self.broken.set()
            log.warning(kv("step_abandoned", version=self.version, error=exc))
            return None
        except Exception as exc:
            self._release([s.sample_id for g in groups for s in g], exc)
            raise
        return result, time.monotonic() - started

    def _record(self, record: StepRecord) -> None:
        """A step taken (trained, or dropped whole): remembered (dedup), to be committed."""
        self._recent = [*self._recent, record][-self._config.keep_trained_steps :]
        self._trained = {sid for r in self._recent for sid in r.sample_ids}
        self._commits.uncommitted.append(record)

    async def _settle(
        self,
        consumed: list[str],
        dropped: tuple[tuple[str, str], ...],
        items: list[TrainItem],
        stats: StepStats,
        seconds: float,
    ) -> None:
        """A step trained: version v+1, committed (when a checkpoint is due, ``Commits.due``: a
        snapshot, written in the background with the steps log; its samples acked once both are
        durable; else acked now), then published; metrics."""
        stepped = time.monotonic()
        STEP_SECONDS.observe(seconds)
        version = self.version + 1
        self.version = version
        self._record(StepRecord(version, tuple(consumed), dropped))
        if self._commits.due(version):
            await self._commits.commit(self.version, self._recent, consumed)
        else:
            self._release(consumed)
        await self._publisher.publish(version, self._ranks.backend.hf_state_dict)
        VERSION.set(version)
        self._watch.stepped(version, stepped)
        if self._roles is not None:
            try:
                await self._roles.registration.put(version=version)
            except NatsError as exc:  # the next heartbeat writes the entry, with this version
                log.warning(kv("registration_put_failed", version=version, error=exc))
        report_step(self.version, items, stats, seconds)

    def _write_failed(self) -> None:
        """A commit's write failed (``trainer.commits``): take no sample again (it would count
        as trained); the loop raises."""
        self._stopping = True
        self._wake.set()

    # -- serving ----------------------------------------------------------------------------
    async def serve(
        self,
        provision: ProvisionConfig,
        roles: RoleHolder,
        stop: asyncio.Event,
        on_ready=lambda: None,
    ) -> None:
        """Publish what a crash may have left unpublished, then consume samples and step until
        ``stop`` (or until training, consuming or following workers fails: that raises).
        ``roles`` belongs to whoever opened the membership (``broker.roles.membership``)."""
        self._roles = roles
        self._provision = provision
        # samples held only for their checkpoint: admission leaves them out of what is outstanding
        self._commits.on_trained_unacked = lambda n: roles.registration.put_soon(trained_unacked=n)
        # earlier tasks a step waits for: the scheduler lends this worker for them (colocated)
        self._order_wait.on_waiting = lambda n: roles.registration.put_soon(order_waiting=n)
        names = self._names
        await durable_info(self._js, names, names.samples_stream, Durable.TRAINER, stop=stop)
        if not self._grouped:  # else once it is the group's rank 0: ``resume``
            await self.publish_if_missing()
        consuming = asyncio.create_task(self._consume(stop))
        following = asyncio.create_task(self._watch.follow(self._js, names))  # until cancelled
        uploading = asyncio.create_task(self._publisher.run())
        stepping = asyncio.create_task(self.run(stop))
        log.info(kv("trainer_started", run=names.run, version=self.version))
        on_ready()
        try:
            # Training, consuming and uploading must all keep running.
            await asyncio.wait(
                {stepping, consuming, uploading, asyncio.create_task(stop.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            # Stop fetching, finish the step in progress, hand back held samples, let the
            # ingress settle them. Fetching stops first: a sample fetched after the hand-back is
            # handed back at once, and fetched again, until JetStream gives it up at max_deliver
            # (the fault suite lost a group so). Every part is stopped whatever the others
            # raise, and the first error is the one told.
            stop.set()
            self._ingress_stop.set()
            await asyncio.gather(stepping, return_exceptions=True)
            self._commits.writer.close()  # idle: the loop finished every write it submitted
            self._publisher.close()  # the last version's upload ends first
            await asyncio.gather(uploading, return_exceptions=True)
            await asyncio.gather(consuming, return_exceptions=True)
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        for task, what in (
            (stepping, "training"),
            (consuming, "consuming samples"),
            (uploading, "uploading weights"),
        ):
            if task.exception() is not None:
                raise TrainerError(f"{what} failed: {task.exception()!r}") from task.exception()

    def _samples(self, provision: ProvisionConfig) -> Ingress[SampleReady]:
        """The validated ingress of the run's samples, handled by ``on_sample``."""
        return Ingress(
            self._js,
            self._names,
            source="trainer",
            stream=self._names.samples_stream,
            durable=Durable.TRAINER,
            schema=SampleReady,
            handler=self.on_sample,
            max_payload=provision.samples.max_payload,
            batch=256,
            concurrency=self._config.max_pending_samples,
            fetch_timeout=0.5,
        )

    # -- start ------------------------------------------------------------------------------
    async def publish_if_missing(self) -> None:
        """After a restart: publish the checkpoint's version if the weights stream lacks it
        (the process died between the checkpoint and the publication), or as a new version
        after those published since it (its checkpoint's write was cut)."""
        published, local_only = await self._publisher.announced()
        if 0 < published - self.version < 2 * self._config.checkpoint_every:
            # The steps since the last durable checkpoint died with the process (those between
            # checkpoints had their samples acknowledged: lost too; a checkpoint's own step's
            # come back). Their versions stay taken: a version names one set of weights, so
            # these weights go on after them, checkpointed at once (a second crash resumes here).
            log.warning(kv("versions_lost", checkpoint=self.version, published=published))
            self.version = published + 1
            if self._config.checkpoint_dir is not None:
                state = await self._commits.checkpoint(self.version, self._recent)
                await self._commits.writer.submit(state, ())
        if published > self.version:
            raise TrainerError(
                f"the weights stream of run {self._names.run} already has v{published} but this "
                f"trainer starts at v{self.version} (checkpoint_dir="
                f"{self._config.checkpoint_dir}): use the checkpoint that produced it or a new run"
            )
        if self.version > published or local_only:
            # unpublished, or announced as a host-local copy only: publish it for every host
            await self._publisher.publish(self.version, self._ranks.backend.hf_state_dict)
        VERSION.set(self.version)
