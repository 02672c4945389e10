"""The trainer group record: the workers ``assign`` gives ``train`` form one data-parallel
group, written as ``TrainerGroup`` (key ``trainer-group`` of the run's state bucket) whenever
that set changes. Its members find each other through it (``trainer.group``).

Rank = index in ``members``. The order is the record's own, not the assignment's: a member
keeps its place while it stays, newcomers go to the end, so rank 0 (the member that takes the
samples and holds the committed state) stays the same worker for as long as it is assigned.
Lending changes roles, not the group: a lent member stays a member.

The record outlives the scheduler (the state bucket has no TTL): one taking over continues its
generation, so a generation names one membership for the whole run. Each write is a
compare-and-set on the revision this scheduler read or wrote, so a deposed scheduler cannot
overwrite its successor's record: its write fails and it stops leading (``LeaseLostError``).
"""

import logging
import time

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from broker import codec
from broker.control import TrainerGroup
from broker.subjects import RunNames
from common.log import kv
from tagsched.exceptions import LeaseLostError
from tagsched.metrics import GROUP_CHANGES, GROUP_GENERATION, GROUP_SIZE

log = logging.getLogger(__name__)


def next_members(current: list[str], train: list[str]) -> list[str]:
    """The group's members for the workers assigned ``train``: the current ones that remain,
    in their order, then the new ones in the assignment's."""
    return [w for w in current if w in train] + [w for w in train if w not in current]


class GroupRecord:
    """The scheduler's writer of the trainer group record."""

    def __init__(self, js: JetStreamContext, names: RunNames) -> None:
        self._js = js
        self._names = names
        self._record: TrainerGroup | None = None
        self._revision = 0  # of the record read or last written: each write is a CAS on it
        self._read = False
        self._bucket: KeyValue | None = None  # opened once: each open is a stream info request

    async def _state(self) -> KeyValue:
        if self._bucket is None:
            self._bucket = await self._js.key_value(self._names.state_kv)
        return self._bucket

    async def members(self) -> list[str]:
        """The group's members now (``assign`` keeps them training, a lent one included)."""
        if not self._read:  # a scheduler taking over continues the record it finds
            bucket = await self._state()
            try:
                entry = await bucket.get(RunNames.TRAINER_GROUP_KEY)
                self._record = codec.decode(TrainerGroup, entry.value)
                self._revision = entry.revision
            except KeyNotFoundError:
                self._record, self._revision = None, 0
            self._read = True
        return self._record.members if self._record else []

    async def follow(self, train: list[str]) -> None:
        """Write a new generation if the workers assigned ``train`` are not the members."""
        current = await self.members()
        members = next_members(current, train)
        if self._record is not None and members == current:
            return
        bucket = await self._state()
        record = TrainerGroup(
            generation=self._record.generation + 1 if self._record else 1,
            members=members,
            changed_at=time.time(),
        )
        try:
            if self._revision:
                self._revision = await bucket.update(
                    RunNames.TRAINER_GROUP_KEY, codec.encode(record), last=self._revision
                )
            else:
                self._revision = await bucket.create(
                    RunNames.TRAINER_GROUP_KEY, codec.encode(record)
                )
        except KeyWrongLastSequenceError as exc:
            # Another scheduler wrote it since: this one no longer leads (read it afresh if it
            # leads again).
            self._read = False
            raise LeaseLostError(
                "the trainer group record was written by another scheduler"
            ) from exc
        self._record = record
        joined, left = set(members) - set(current), set(current) - set(members)
        for cause, workers in (("joined", joined), ("left", left)):
            GROUP_CHANGES.labels(cause).inc(len(workers))
        GROUP_SIZE.set(len(members))
        GROUP_GENERATION.set(record.generation)
        log.info(
            kv(
                "trainer_group",
                generation=record.generation,
                members=",".join(members),
                joined=",".join(sorted(joined)),
                left=",".join(sorted(left)),
            )
        )
