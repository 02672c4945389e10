"""The scheduler's durable state: ``SchedulerState`` as key ``scheduler`` of the run's state
bucket (``sf-<run>-state``, no TTL), so that a scheduler taking over continues where the one
before it stopped: the epoch counter, the fences (with the registration each fenced), the
measured switch costs the lending policy decides by, and the group sizes of recent tasks that
admission counts by. Lends need no record of their own: a trainer worker lent to rollout is one
whose registry entry says ``rollout``.

The revision is the fencing token: every write is a compare-and-set on the revision this
scheduler last wrote. A scheduler taking over first claims the key (a write on the revision it
read, again if the one it deposed wrote in between), so the next write of the deposed one fails
and it stops leading (``LeaseLostError``). Writes that must precede an action are awaited before
it: an epoch is stored before a request carries it, so a successor's epochs are above every
epoch a worker can have been sent. Other changes (a fence lifted, a switch measured) are written
by the next tick. Other keys of the bucket belong to other parts; this store writes only its own.
"""

import asyncio
import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from broker import codec
from broker.control import SchedulerState
from broker.exceptions import InvalidMessageError
from broker.provision import run_bucket
from broker.subjects import RunNames
from common.log import kv
from tagsched.exceptions import LeaseLostError
from tagsched.metrics import STATE_WRITES

log = logging.getLogger(__name__)

KEY = RunNames.SCHEDULER_STATE_KEY


class StateStore:
    """This scheduler's ``SchedulerState``: ``state`` as changed (``change``), written by
    ``flush``."""

    def __init__(self, bucket: KeyValue, leader: str) -> None:
        self._bucket = bucket
        self._leader = leader
        self._revision = 0
        self._lock = asyncio.Lock()  # one write at a time: each on the revision of the last
        self._dirty = False
        self.state = SchedulerState(leader=leader)

    @classmethod
    async def open(cls, js: JetStreamContext, names: RunNames, leader: str) -> "StateStore":
        return cls(await run_bucket(js, names, names.state_kv), leader)

    async def claim(self) -> SchedulerState:
        """Read the state a previous scheduler left and write it back as this one's. A state
        that cannot be decoded is logged and started afresh (epochs still continue above the
        registry's)."""
        while True:
            try:
                found = await self._bucket.get(KEY)
                revision = found.revision or 0
                state = codec.decode(SchedulerState, found.value or b"")
            except KeyDeletedError as exc:
                revision = exc.entry.revision if exc.entry is not None else 0
                state = SchedulerState(leader=self._leader)
            except KeyNotFoundError:
                revision, state = 0, SchedulerState(leader=self._leader)
            except InvalidMessageError as exc:
                log.error(kv("bad_scheduler_state", error=exc.reason, action="starting afresh"))
                state = SchedulerState(leader=self._leader)
            claimed = state.model_copy(update={"leader": self._leader})
            try:
                self._revision = await self._bucket.update(
                    KEY, codec.encode(claimed), last=revision
                )
            except KeyWrongLastSequenceError:  # the deposed scheduler wrote meanwhile
                continue
            STATE_WRITES.labels("claimed").inc()
            log.info(
                kv(
                    "scheduler_state_claimed",
                    previous=state.leader,
                    epoch=state.epoch,
                    fenced=len(state.fenced),
                )
            )
            self.state, self._dirty = claimed, False
            return claimed

    def change(self, **fields: object) -> None:
        """Change the state here; the next ``flush`` writes it."""
        self.state = self.state.model_copy(update=fields)
        self._dirty = True

    async def flush(self) -> None:
        """Write the state if it changed: raises ``LeaseLostError`` once another scheduler has
        written it (this one was deposed), and the broker's errors as they are (the change
        stays, for the next flush)."""
        async with self._lock:
            if not self._dirty:
                return
            state = self.state
            try:
                self._revision = await self._bucket.update(
                    KEY, codec.encode(state), last=self._revision
                )
            except KeyWrongLastSequenceError as exc:
                STATE_WRITES.labels("deposed").inc()
                raise LeaseLostError(
                    f"scheduler {self._leader}: another scheduler wrote the run's state"
                ) from exc
            STATE_WRITES.labels("written").inc()
            self._dirty = self.state is not state
