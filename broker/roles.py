"""The worker side of the control plane: the role a worker holds, changed by the scheduler.

A worker process holds one role at a time (``Role``: rollout, train or idle) under an epoch. The
scheduler sends ``RoleChangeRequested`` as a core NATS request on
``sf.<run>.ctl.role.<worker_id>``; the worker answers ``RoleChangeAcked``:

- an epoch not above the one it holds is refused: ``ok=false`` with its current role and epoch
  (a scheduler that took over learns where to continue from);
- a request received after its ``expires_at`` is refused (``expired``): the scheduler has fenced
  the worker meanwhile (the worker was frozen, or the request was held up on the way);
  ``expires_at`` is on this worker's own clock (the scheduler states it from the worker's last
  heartbeat, ``heartbeat_at``, plus the time since it saw it written), so no two machines'
  clocks are compared;
- otherwise it switches (``switch(role)``: the engine released warm or woken, the trainer's step
  gate closed or opened), writes its registry entry (role, epoch) and acks ``ok=true``; a switch
  that fails acks ``ok=false`` with the error and the worker keeps the role it had;
- a switch that ends after ``expires_at`` has been fenced by the scheduler in the meantime: the
  worker goes idle and begins a new registration, which is what re-admits it.

**The role is a lease.** The worker holds it while it keeps writing its registry entry: each
write that succeeds extends it by ``role_lease_s`` (``ROLE_LEASE_SHARE`` of the registry's TTL,
measured from when the write was sent, so it ends before the scheduler, counting the TTL from
when the write was stored, gives the role to another). A worker that cannot write for that long
(cut off from the broker) gives the role up by itself: idle (the rollout worker stops fetching
and routing, the trainer stops stepping), and a new registration, so that it is re-admitted
once it writes again. With each heartbeat it also reads the scheduler's state
(``SchedulerState``, bucket ``sf-<run>-state``): a fence on its current registration (an ack the
scheduler never got) makes it give the role up the same way.

Requests are handled one at a time, in arrival order. Rollout workers and trainers both hold their
role through this class, so both export the same ``sf_worker_*`` metrics, and both register with
``membership``: one lifecycle for every process that holds a role.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker import codec
from broker.control import SchedulerState
from broker.exceptions import InvalidMessageError
from broker.messages import Role
from broker.provision import run_bucket
from broker.registry import Registration
from broker.retry import retry
from broker.subjects import RunNames
from broker.worker_messages import RoleChangeAcked, RoleChangeRequested
from common.log import kv

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

ROLE = Gauge("sf_worker_role", "1 for the role this worker holds now", ["role"], registry=REGISTRY)
ROLE_SECONDS = Counter(
    "sf_worker_role_seconds",
    "Seconds spent per role, busy (working in it) or idle (holding it with nothing to do)",
    ["role", "state"],
    registry=REGISTRY,
)
ROLE_CHANGES = Counter(
    "sf_worker_role_changes",
    "Role change requests, by outcome (applied, stale, expired: received after its expiry, "
    "failed, overran: switched after its expiry)",
    ["outcome"],
    registry=REGISTRY,
)
SWITCH_SECONDS = Histogram(
    "sf_worker_role_switch_seconds",
    "From a role change request to this worker working in the new role, by new role",
    ["role"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
TAGS = Gauge(
    "sf_worker_tags",
    "1, labelled with this worker's capability tags (comma-separated): join on instance",
    ["tags"],
    registry=REGISTRY,
)
INFO = Gauge(
    "sf_worker_info",
    "1, labelled with this worker's node (its registry entry's host), id and capability tags: "
    "join on instance to show or group any sf_worker_ series by node",
    ["node", "worker_id", "tags"],
    registry=REGISTRY,
)
BAD_REQUESTS = Counter(
    "sf_worker_bad_role_requests", "Role change requests that could not be read", registry=REGISTRY
)
GIVEN_UP = Counter(
    "sf_worker_roles_given_up",
    "Times this worker went idle by itself: its role lease ran out (lease: no registry write "
    "for role_lease_s) or it read that the scheduler fenced its registration (fenced)",
    ["reason"],
    registry=REGISTRY,
)
LEASE = Gauge(
    "sf_worker_role_lease_seconds",
    "How long this worker holds its role without a registry write (role_lease_s)",
    registry=REGISTRY,
)
BAD_STATE = Counter(
    "sf_worker_bad_scheduler_state",
    "Reads of the scheduler's state (for this worker's fence) that could not be decoded",
    registry=REGISTRY,
)
for _role in Role:  # every role exported from the start
    ROLE.labels(_role.value)
    SWITCH_SECONDS.labels(_role.value)
    for _state in ("busy", "idle"):
        ROLE_SECONDS.labels(_role.value, _state)
for _outcome in ("applied", "stale", "expired", "failed", "overran"):
    ROLE_CHANGES.labels(_outcome)
for _reason in ("lease", "fenced"):
    GIVEN_UP.labels(_reason)

Switch = Callable[[Role], Awaitable[None]]
ACCOUNT_EVERY_S = 1.0
"""How often the time in the current role is added to ``sf_worker_role_seconds``."""
ROLE_LEASE_SHARE = 2 / 3
"""``role_lease_s`` as a share of the registry's TTL (``workers_ttl_s``, read from the bucket, so
the worker and the scheduler hold one setting): the rest of the TTL (10 s of the default 30 s)
is for the switch to idle to end before the scheduler gives the role to another."""


class RoleHolder:
    """Serves a worker's role-change requests and accounts its time per role."""

    def __init__(
        self,
        nc: NATS,
        names: RunNames,
        registration: Registration,
        switch: Switch,
        *,
        lease_s: float,
        state: KeyValue,
    ) -> None:
        """``lease_s``: the role lease (``role_lease_s``); ``state``: the run's state bucket,
        where the scheduler's fences are read."""
        self._nc = nc
        self._names = names
        self._registration = registration
        self._switch = switch
        self._lease_s = lease_s
        self._state = state
        self._lock = asyncio.Lock()
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task] = []
        self._busy = False
        self._since = time.monotonic()
        self._show(registration.entry.role)
        LEASE.set(lease_s)
        entry = registration.entry
        TAGS.labels(",".join(entry.tags)).set(1)
        INFO.labels(entry.host, entry.worker_id, ",".join(entry.tags)).set(1)

    @property
    def registration(self) -> Registration:
        return self._registration

    @property
    def role(self) -> Role:
        return self._registration.entry.role

    @property
    def epoch(self) -> int:
        return self._registration.entry.epoch

    async def start(self) -> None:
        """Serve role-change requests, then write the entry (waiting while JetStream cannot
        answer), then hold the role from that write. The entry tells the scheduler it may ask,
        and it asks at once: a request before the subscription found no responder, and the
        worker was fenced on its first role change (a loaded CI machine's ``seamlessflow run``
        saw it)."""
        subject = self._names.ctl_role(self._registration.worker_id)
        self._sub = await self._nc.subscribe(subject, cb=self._on_request)
        await self._nc.flush()  # the server knows the subscription before anyone is told
        await retry(self._registration.put, what="registration")
        self._tasks = [asyncio.create_task(self._tick()), asyncio.create_task(self._hold())]

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.account()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(ACCOUNT_EVERY_S)
            self.account()

    def set_busy(self, busy: bool) -> None:
        """Say whether the worker is working in its role now: counted at once, written to the
        registry with the next heartbeat (a write per request would flood the bucket)."""
        if busy == self._busy:
            return
        self.account()
        self._busy = busy
        self._registration.note(busy=busy)

    def account(self) -> None:
        """Add the time since the last call to the current role and state."""
        now = time.monotonic()
        state = "busy" if self._busy else "idle"
        ROLE_SECONDS.labels(self.role.value, state).inc(now - self._since)
        self._since = now

    async def _on_request(self, msg: Msg) -> None:
        received = time.monotonic()
        try:
            request = codec.decode(RoleChangeRequested, msg.data)
        except InvalidMessageError as exc:
            BAD_REQUESTS.inc()
            log.warning(kv("bad_role_request", subject=msg.subject, error=exc.reason))
            await self._reply(msg, self.role, self.epoch, False, f"bad request: {exc.reason}")
            return
        async with self._lock:
            await self._apply(msg, request, received)

    async def _apply(self, msg: Msg, request: RoleChangeRequested, received: float) -> None:
        worker = self._registration.worker_id
        if request.worker_id != worker or request.epoch <= self.epoch:
            ROLE_CHANGES.labels("stale").inc()
            why = (
                f"addressed to {request.worker_id}"
                if request.worker_id != worker
                else f"stale epoch {request.epoch}: this worker holds epoch {self.epoch}"
            )
            await self._reply(msg, self.role, self.epoch, False, why)
            return
        if (late := self._registration.now() - request.expires_at) > 0:
            # Frozen, or held up on the way: the scheduler has fenced this worker meanwhile.
            ROLE_CHANGES.labels("expired").inc()
            log.warning(
                kv("role_change_expired", role=request.role, epoch=request.epoch, late_s=late)
            )
            why = f"expired {late:.3f}s before it was handled: this worker keeps {self.role}"
            await self._reply(msg, self.role, self.epoch, False, why)
            return
        try:
            if request.role is not self.role:
                await self._switch(request.role)
        except Exception as exc:  # the worker keeps its role; the scheduler decides what next
            ROLE_CHANGES.labels("failed").inc()
            log.error(kv("role_change_failed", role=request.role, epoch=request.epoch, error=exc))
            await self._reply(msg, self.role, self.epoch, False, f"switch failed: {exc!r}")
            return
        seconds = time.monotonic() - received
        if self._registration.now() > request.expires_at:
            # Fenced meanwhile: give the role up and come back as a new registration.
            ROLE_CHANGES.labels("overran").inc()
            log.warning(kv("role_change_overran", role=request.role, seconds=round(seconds, 3)))
            if request.role is not Role.IDLE:
                await self._switch(Role.IDLE)
            self._registration.renew()
            await self._change(Role.IDLE, request.epoch)
            return
        await self._change(request.role, request.epoch)
        ROLE_CHANGES.labels("applied").inc()
        SWITCH_SECONDS.labels(request.role.value).observe(seconds)
        log.info(kv("role_changed", role=request.role, epoch=request.epoch, reason=request.reason))
        await self._reply(msg, request.role, request.epoch, True)

    async def _change(self, role: Role, epoch: int) -> None:
        self._held(role)
        await self._registration.put(role=role, epoch=epoch, busy=False)

    def _held(self, role: Role) -> None:
        """Account the time in the old role; show ``role`` (not busy yet)."""
        self.account()
        self._busy = False
        self._show(role)
        self._registration.note(role=role, busy=False)

    # -- the role lease ---------------------------------------------------------------------
    async def _hold(self) -> None:
        """Give the role up once no registry write has succeeded for ``lease_s``; then wait for
        one (the worker is back) before counting the lease again."""
        while True:
            left = self._registration.written_at + self._lease_s - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
                continue
            back = asyncio.create_task(self._registration.next_write())
            try:
                await self._give_up("lease")
                await back
            finally:
                back.cancel()

    async def check_fence(self) -> None:
        """Read the scheduler's state; give the role up if it fenced this registration (the
        scheduler gave up waiting for an ack: the role is another worker's now). Called after
        every heartbeat; a state that cannot be read is counted and logged, and changes
        nothing."""
        try:
            found = await self._state.get(RunNames.SCHEDULER_STATE_KEY)
        except KeyNotFoundError:  # no scheduler has led this run yet
            return
        try:
            state = codec.decode(SchedulerState, found.value or b"")
        except InvalidMessageError as exc:
            BAD_STATE.inc()
            log.warning(kv("bad_scheduler_state", bucket=self._names.state_kv, error=exc.reason))
            return
        fence = state.fence(self._registration.worker_id)
        if fence is not None and fence.started_at == self._registration.entry.started_at:
            await self._give_up("fenced")

    async def _give_up(self, reason: str) -> None:
        """Go idle by itself and begin a new registration: the next write that succeeds shows
        it, and the scheduler re-admits it."""
        async with self._lock:
            GIVEN_UP.labels(reason).inc()
            log.warning(kv("role_given_up", role=self.role, epoch=self.epoch, reason=reason))
            if self.role is not Role.IDLE:
                try:
                    await self._switch(Role.IDLE)
                except Exception as exc:  # never ends the heartbeats; the TTL still ends the role
                    ROLE_CHANGES.labels("failed").inc()
                    log.error(kv("role_give_up_failed", role=self.role, error=exc))
                else:
                    self._held(Role.IDLE)
            self._registration.renew()

    @staticmethod
    def _show(role: Role) -> None:
        for r in Role:
            ROLE.labels(r.value).set(1 if r is role else 0)

    async def _reply(
        self, msg: Msg, role: Role, epoch: int, ok: bool, error: str | None = None
    ) -> None:
        ack = RoleChangeAcked(
            worker_id=self._registration.worker_id, role=role, epoch=epoch, ok=ok, error=error
        )
        try:
            await msg.respond(codec.encode(ack))
        except NatsError as exc:  # the scheduler times out and asks again or fences
            log.warning(kv("role_ack_failed", epoch=epoch, error=exc))


@contextlib.asynccontextmanager
async def membership(
    nc: NATS, names: RunNames, registration: Registration, switch: Switch, *, heartbeat_s: float
) -> AsyncIterator[RoleHolder]:
    """A process's membership of the run: take the entry's role (``switch``), serve role-change
    requests, write the entry, renew the entry every ``heartbeat_s`` (reading the scheduler's
    fences after each), hold the role as a lease. On the way out, normal or not: stop the
    heartbeats, stop the role requests, delete the entry, in that order, each step taken even if
    one before it raised."""
    async with contextlib.AsyncExitStack() as leave:  # runs its callbacks last-in, first-out
        await switch(registration.entry.role)
        # A process joining while JetStream cannot answer (leaders moving after an outage) waits
        # for it, rather than exiting.
        ttl = await retry(registration.ttl, what="registry_ttl")
        js = nc.jetstream()
        state = await retry(lambda: run_bucket(js, names, names.state_kv), what="state_bucket")
        lease_s = ttl * ROLE_LEASE_SHARE
        roles = RoleHolder(nc, names, registration, switch, lease_s=lease_s, state=state)
        leave.push_async_callback(registration.delete)
        leave.push_async_callback(roles.stop)
        await roles.start()  # writes the entry
        heartbeat = asyncio.create_task(registration.keep_alive(heartbeat_s, roles.check_fence))
        leave.push_async_callback(_cancel, heartbeat)
        yield roles


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
