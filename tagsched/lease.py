"""One active scheduler per run: a lease held as the key ``scheduler`` of the run's control bucket
(``sf-<run>-control``), whose entries expire ``scheduler_lease_s`` after their last write.

The holder renews with a compare-and-set on the revision it wrote every ``ttl / 3``; a standby
tries to create the key every ``TRY_S`` (or ``ttl / 3``, if shorter), which succeeds only once
the holder's entry has expired or been deleted. So a standby takes over within ``ttl + TRY_S``
of the holder's death (and the server's expiry sweep, up to a second here), and two holders
never renew the same lease: a renewal that finds another revision has lost it. A try that
JetStream cannot answer now (leaders being elected, this client's server cut off) is logged,
counted in ``sf_nats_retries_total{what="lease_acquire"}`` and made again a period later.

**A restarted scheduler leads at once.** A holder that has just started takes over a lease held
under its own id without waiting for it to expire: that is its previous run's, killed (kill -9,
a crash, a supervisor's restart), which would otherwise stop admission for up to a TTL and a
period. Only the first acquire of a process does so; a holder that lost the lease waits like any
standby. So a scheduler id must be stable across restarts and unique among the schedulers of a
run (the default, ``scheduler-<host>``, is both where one scheduler runs per host: a pod, a
Slurm node); two processes given one id would take the lease from each other once, then the one
deposed stands by (``tagsched.state``'s fencing keeps it from writing anything meanwhile).
"""

import asyncio
import contextlib
import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from broker.metrics import NATS_RETRIES
from broker.retry import TRANSIENT
from broker.subjects import RunNames
from common.log import kv
from tagsched.exceptions import LeaseLostError

log = logging.getLogger(__name__)

KEY = "scheduler"
TRY_S = 0.5
"""How often a standby tries to take the lease (at most: ``ttl / 3`` if shorter)."""


class Lease:
    def __init__(self, bucket: KeyValue, holder: str, ttl: float) -> None:
        self._bucket = bucket
        self.holder = holder
        self.ttl = ttl
        self._revision = 0
        self._restarted = True  # until the first acquire: a lease under this id is its own

    @classmethod
    async def open(cls, js: JetStreamContext, names: RunNames, holder: str, ttl: float) -> "Lease":
        return cls(await js.key_value(names.control_kv), holder, ttl)

    @property
    def period(self) -> float:
        """How often to renew (and, waiting, to try again)."""
        return self.ttl / 3

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this holder has the lease (True) or ``stop`` is set (False)."""
        announced = False
        while not stop.is_set():
            try:
                self._revision = await self._take()
            except (KeyWrongLastSequenceError, KeyNotFoundError):
                announced = announced or await self._announce_waiting()
            except TRANSIENT as exc:  # JetStream electing leaders, this client's server cut off
                NATS_RETRIES.labels("lease_acquire").inc()
                error = f"{type(exc).__name__}: {exc}"
                log.warning(kv("lease_unreachable", holder=self.holder, error=error))
            else:
                log.info(kv("lease_acquired", holder=self.holder))
                self._restarted = False
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(TRY_S, self.period))
        return False

    async def _take(self) -> int:
        """Create the key; a process that has just started also takes it over when it holds
        this holder's id (its previous run's). The revision written."""
        try:
            return await self._bucket.create(KEY, self.holder.encode())
        except KeyWrongLastSequenceError:
            entry = await self._bucket.get(KEY) if self._restarted else None
            if entry is None or entry.value != self.holder.encode():
                raise
        log.info(kv("lease_taken_over", holder=self.holder, why="its own, before a restart"))
        return await self._bucket.update(KEY, self.holder.encode(), last=entry.revision)

    async def _announce_waiting(self) -> bool:
        """Log who holds the lease (once, when it can be read)."""
        try:
            current = await self.current()
        except TRANSIENT:
            return False
        log.info(kv("lease_waiting", holder=self.holder, held_by=current))
        return True

    async def renew(self) -> None:
        try:
            self._revision = await self._bucket.update(
                KEY, self.holder.encode(), last=self._revision
            )
        except KeyWrongLastSequenceError as exc:
            raise LeaseLostError(
                f"scheduler {self.holder} lost the lease to {await self.current()}"
            ) from exc

    async def release(self) -> None:
        """Give the lease up at once, so a standby need not wait for it to expire."""
        with contextlib.suppress(KeyWrongLastSequenceError):  # someone else holds it already
            await self._bucket.delete(KEY, last=self._revision)

    async def current(self) -> str | None:
        """Who holds the lease now, if anyone."""
        return await _holder(self._bucket)


async def lease_holder(js: JetStreamContext, names: RunNames) -> str | None:
    """Which scheduler leads run ``names`` now, if any (for readers such as ``status``)."""
    return await _holder(await js.key_value(names.control_kv))


async def _holder(bucket: KeyValue) -> str | None:
    try:
        entry = await bucket.get(KEY)
    except KeyNotFoundError:  # absent, deleted or expired: nobody
        return None
    return entry.value.decode() if entry.value else None
