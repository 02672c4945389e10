"""A worker's part in the trainer group: the workers the scheduler assigns to ``train`` are one
data-parallel group (``tagsched.group`` writes ``TrainerGroup``, rank = index in ``members``).

- **Rank 0** takes the samples (``Trainer.lead``) and steps; the other members and any worker
  outside the group hand back what they hold and take none.
- **Rendezvous**, no address given by hand: rank 0 opens a ``torch.distributed`` store on a
  free port of its host (``rendezvous_host``: its pod's address on Kubernetes, else its node's
  name) and writes ``TrainerRendezvous`` (generation, attempt, host, port) to the run's state
  bucket; the other members read it and join (gloo on CPU, nccl on CUDA). Joining waits at
  most ``collective_timeout_s``.
- **Forming**: rank 0 sends its committed model and optimizer state to every rank, so a member
  that joins starts from exactly it; then each step is broadcast and every rank trains its
  shard (``trainer.ranks``). An idle group is pinged every third of the timeout.
- **Re-forming**: a new generation (a member joined or left), or a failed collective (a member
  died: ``GroupBrokenError``, the step abandoned and its samples trained in the next group's
  first step). Rank 0 forms again, as a new attempt of the current generation until the
  scheduler writes the next one (a dead member is dropped once its registry entry goes stale,
  ``workers_ttl_s``). A group of one is no ``torch.distributed`` group at all.
- **Rank 0 gone**: the scheduler makes the next member rank 0 (its generation has it first); it
  resumes from the newest checkpoint in ``checkpoint_dir`` (``Trainer.resume``: a local run
  shares one) and the samples the old rank 0 held come back to it once their ack wait runs out.

A worker with ``trainer.world_size > 1`` (local ranks) is refused a place in a group of several
(an ERROR and a count; it takes no samples): the two are not combined.
"""

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch.distributed as dist
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from broker import codec
from broker.control import TrainerGroup, TrainerRendezvous
from broker.exceptions import InvalidMessageError
from broker.registry import node_name
from broker.roles import RoleHolder
from broker.subjects import RunNames
from common.log import kv
from trainer.exceptions import GroupBrokenError
from trainer.metrics import (
    GROUP_GENERATION,
    GROUP_INVALID,
    GROUP_RANK,
    GROUP_REFORMS,
    GROUP_REFUSED,
    GROUP_SIZE,
    RENDEZVOUS_SECONDS,
)
from trainer.ranks import RankGroup
from trainer.service import Trainer
from trainer.waits import wait_first

log = logging.getLogger(__name__)


class GroupLink:
    """Follows the group record and plays this worker's rank in it, until ``run``'s stop."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        worker_id: str,
        host: str,
        trainer: Trainer,
        ranks: RankGroup,
        timeout_s: float,
        roles: RoleHolder,
    ) -> None:
        self._js = js
        self._names = names
        self._me = worker_id
        self._host = host
        self._trainer = trainer
        self._ranks = ranks
        self._timeout = timedelta(seconds=timeout_s)
        self._roles = roles  # a follower's training is its busy time, as rank 0's
        self._group: TrainerGroup | None = None
        self._rendezvous: TrainerRendezvous | None = None
        self._changed = asyncio.Event()  # a new group record or rendezvous
        self._led = False  # rank 0 of the last group it was in: its state is the committed one
        self._refused_generation = 0

    async def run(self, stop: asyncio.Event) -> None:
        bucket = await self._js.key_value(self._names.state_kv)
        watching = asyncio.create_task(self._watch(bucket))
        try:
            while not stop.is_set():
                group = self._group
                if group is None or self._me not in group.members or self._refused(group):
                    self._led = False
                    await self._trainer.lead(False)
                    GROUP_RANK.set(-1)
                    await self._wait(stop)
                    continue
                GROUP_SIZE.set(len(group.members))
                GROUP_GENERATION.set(group.generation)
                rank = group.members.index(self._me)
                GROUP_RANK.set(rank)
                if rank == 0:
                    await self._lead(bucket, group, stop)
                else:
                    self._led = False
                    await self._follow(group, rank, stop)
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)

    def _refused(self, group: TrainerGroup) -> bool:
        """Whether this worker cannot be a rank of ``group`` (told once per generation)."""
        world = self._ranks.local_world_size
        if len(group.members) <= 1 or world <= 1:
            return False
        if group.generation != self._refused_generation:
            self._refused_generation = group.generation
            GROUP_REFUSED.inc()
            log.error(
                kv(
                    "trainer_group_refused",
                    generation=group.generation,
                    error=f"trainer.world_size = {world} (local ranks) cannot join a trainer "
                    f"group of {len(group.members)} workers: set it to 1 on grouped workers",
                )
            )
        return True

    async def _watch(self, bucket: KeyValue) -> None:
        """Keep ``_group`` and ``_rendezvous`` current (a dropped watch is started again)."""
        keys = {
            RunNames.TRAINER_GROUP_KEY: ("_group", TrainerGroup),
            RunNames.TRAINER_RENDEZVOUS_KEY: ("_rendezvous", TrainerRendezvous),
        }
        while True:
            try:
                watcher = await bucket.watchall()
                async for entry in watcher:
                    if entry is None or entry.key not in keys or not entry.value:
                        continue
                    attribute, schema = keys[entry.key]
                    try:
                        setattr(self, attribute, codec.decode(schema, entry.value))
                    except InvalidMessageError as exc:
                        GROUP_INVALID.inc()
                        log.warning(kv("trainer_group_entry_invalid", key=entry.key, error=exc))
                        continue
                    self._changed.set()
            except NatsError as exc:
                log.warning(kv("trainer_group_watch_failed", error=exc))
            await asyncio.sleep(1.0)

    async def _wait(self, stop: asyncio.Event, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Until the group record or the rendezvous changes, ``stop``, or ``timeout``."""
        await wait_first(self._changed.wait(), stop.wait(), timeout=timeout)
        self._changed.clear()

    def _current(self, group: TrainerGroup) -> bool:
        return self._group is not None and self._group.generation == group.generation

    # -- rank 0 -------------------------------------------------------------------------------
    async def _lead(self, bucket: KeyValue, group: TrainerGroup, stop: asyncio.Event) -> None:
        """Be rank 0 of ``group`` until a new generation or ``stop``: take samples, form the
        group (again after each failure), keep it alive between steps."""
        if not self._led:  # becoming rank 0: carry on from the previous one's checkpoint
            await self._trainer.resume()
            self._led = True
        await self._trainer.lead(True)
        trainer = self._trainer
        attempt = 0
        cause = "membership"
        try:
            while self._current(group) and not stop.is_set():
                if len(group.members) == 1:  # alone: no torch.distributed group
                    trainer.formed(True)
                    await self._wait(stop)
                    continue
                attempt += 1
                async with trainer.stepping:
                    trainer.formed(False)
                    formed = await self._form(bucket, group, attempt, cause, stop)
                if not formed:
                    cause = "rendezvous"
                    await self._wait(stop, timeout=1.0)  # a dead member: a new generation soon
                    continue
                trainer.formed(True)
                cause = await self._keep(group, stop)
        finally:
            trainer.formed(False)
            async with trainer.stepping:
                await asyncio.to_thread(self._ranks.leave)

    async def _form(
        self, bucket: KeyValue, group: TrainerGroup, attempt: int, cause: str, stop: asyncio.Event
    ) -> bool:
        started = time.monotonic()
        world = len(group.members)
        store = await asyncio.to_thread(_open_store, world, self._timeout)
        rendezvous = TrainerRendezvous(
            generation=group.generation,
            attempt=attempt,
            members=group.members,
            host=self._host,
            port=store.port,
        )
        await bucket.put(RunNames.TRAINER_RENDEZVOUS_KEY, codec.encode(rendezvous))
        join = partial(self._ranks.join, store, 0, world, self._timeout)
        try:
            if not await on_daemon_thread(join, "trainer-group-rank0", stop):
                return False  # stopping: the join ends by itself, by its timeout at worst
        except (GroupBrokenError, RuntimeError) as exc:  # RuntimeError: the rendezvous timed out
            gen = group.generation
            log.warning(kv("trainer_group_not_formed", generation=gen, attempt=attempt, error=exc))
            return False
        seconds = time.monotonic() - started
        RENDEZVOUS_SECONDS.observe(seconds)
        GROUP_REFORMS.labels(cause).inc()
        log.info(
            kv(
                "trainer_group_formed",
                generation=group.generation,
                attempt=attempt,
                world=world,
                seconds=round(seconds, 3),
                cause=cause,
            )
        )
        return True

    async def _keep(self, group: TrainerGroup, stop: asyncio.Event) -> str:
        """While the group is formed: ping it when idle; return why it must form again."""
        period = self._timeout.total_seconds() / 3
        while self._current(group) and not stop.is_set():
            if self._trainer.broken.is_set():
                return "failure"
            await wait_first(
                self._trainer.broken.wait(), self._wait(stop, timeout=period), timeout=period
            )
            if self._trainer.broken.is_set() or not self._current(group) or stop.is_set():
                continue
            if self._trainer.stepping.locked():
                continue  # a step is the ping
            async with self._trainer.stepping:
                try:
                    await asyncio.to_thread(self._ranks.ping)
                except GroupBrokenError as exc:
                    log.warning(kv("trainer_group_broken", generation=group.generation, error=exc))
                    return "failure"
        if self._current(group):
            return "membership"
        async with self._trainer.stepping:  # a new generation: end this one cleanly
            await asyncio.to_thread(self._ranks.leave)
        return "membership"

    # -- the other ranks ----------------------------------------------------------------------
    async def _follow(self, group: TrainerGroup, rank: int, stop: asyncio.Event) -> None:
        """Be rank ``rank`` of ``group``: take no samples; join each formation rank 0 announces
        and run its commands (on a thread of its own: a follower blocked in a collective must
        not keep this process from exiting)."""
        await self._trainer.lead(False)
        joined: tuple[int, int] = (0, 0)
        while self._current(group) and not stop.is_set():
            rendezvous = self._rendezvous
            if (
                rendezvous is None
                or rendezvous.generation != group.generation
                or (rendezvous.generation, rendezvous.attempt) <= joined
            ):
                await self._wait(stop)
                continue
            joined = (rendezvous.generation, rendezvous.attempt)
            busy = partial(asyncio.get_running_loop().call_soon_threadsafe, self._roles.set_busy)
            member = partial(self._member, rendezvous, rank, time.monotonic(), busy)
            try:
                await on_daemon_thread(member, f"trainer-group-rank{rank}", stop)
            except (GroupBrokenError, RuntimeError) as exc:
                log.warning(kv("trainer_group_left", generation=group.generation, error=exc))

    def _member(
        self,
        rendezvous: TrainerRendezvous,
        rank: int,
        started: float,
        busy: Callable[[bool], None],
    ) -> None:
        """Join ``rendezvous`` as ``rank`` and run rank 0's commands (blocking)."""
        store = dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            len(rendezvous.members),
            is_master=False,
            timeout=self._timeout,
        )
        self._ranks.join(store, rank, len(rendezvous.members), self._timeout)
        RENDEZVOUS_SECONDS.observe(time.monotonic() - started)
        gen, attempt = rendezvous.generation, rendezvous.attempt
        log.info(kv("trainer_group_joined", generation=gen, rank=rank, attempt=attempt))
        self._ranks.follow_group(busy)


async def on_daemon_thread(blocking: Callable[[], None], name: str, stop: asyncio.Event) -> bool:
    """Run ``blocking`` on a thread that never keeps the process from exiting, until it returns
    (True; what it raised is raised here) or ``stop`` (False). A rendezvous waits for every
    member until its timeout, a follower for rank 0's next command: a stopping worker must wait
    for neither, as it would for ``asyncio.to_thread``'s thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():  # stopped: nobody waits for the outcome
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            blocking()
        except BaseException as exc:  # handed to the awaiting side, never lost in the thread
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    await wait_first(asyncio.shield(done), stop.wait())  # the shield is cancelled, not ``done``
    if not done.done():
        done.cancel()  # a late outcome is dropped, not left unretrieved (asyncio logs that)
        return False
    done.result()
    return True


def rendezvous_host() -> str:
    """Where the other members reach this process's store: ``$POD_IP`` where the deployment sets
    it (Kubernetes' downward API ``status.podIP``: a pod's ports are on its own address, not on
    its node's), else the node's name (``broker.registry.node_name``: Slurm's, a cluster
    node's, a local run's)."""
    return os.environ.get("POD_IP") or node_name()


def _open_store(world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, on a free port of every interface of this host."""
    return dist.TCPStore(
        "0.0.0.0", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )
