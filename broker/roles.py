"""The worker side of the control plane: the role a worker holds, changed by the scheduler.

A worker process holds one role at a time (``Role``: rollout, train or idle) under an epoch. The
scheduler sends ``RoleChangeRequested`` as a core NATS request on
``sf.<run>.ctl.role.<worker_id>``; the worker answers ``RoleChangeAcked``:

- an epoch not above the one it holds is refused: ``ok=false`` with its current role and epoch
  (a scheduler that took over learns where to continue from);
- otherwise it switches (``switch(role)``: the engine released warm or woken, the trainer's step
  gate closed or opened), writes its registry entry (role, epoch) and acks ``ok=true``; a switch
  that fails acks ``ok=false`` with the error and the worker keeps the role it had;
- a switch that overruns the request's ``deadline_s`` has been fenced by the scheduler in the
  meantime: the worker goes idle and begins a new registration, which is what re-admits it.

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
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker import codec
from broker.exceptions import InvalidMessageError
from broker.messages import Role, RoleChangeAcked, RoleChangeRequested
from broker.registry import Registration
from broker.retry import retry
from broker.subjects import RunNames
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
    "Role change requests, by outcome (applied, stale, failed, overran)",
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
for _role in Role:  # every role exported from the start
    ROLE.labels(_role.value)
    SWITCH_SECONDS.labels(_role.value)
    for _state in ("busy", "idle"):
        ROLE_SECONDS.labels(_role.value, _state)
for _outcome in ("applied", "stale", "failed", "overran"):
    ROLE_CHANGES.labels(_outcome)

Switch = Callable[[Role], Awaitable[None]]
ACCOUNT_EVERY_S = 1.0
"""How often the time in the current role is added to ``sf_worker_role_seconds``."""


class RoleHolder:
    """Serves a worker's role-change requests and accounts its time per role."""

    def __init__(
        self, nc: NATS, names: RunNames, registration: Registration, switch: Switch
    ) -> None:
        self._nc = nc
        self._names = names
        self._registration = registration
        self._switch = switch
        self._lock = asyncio.Lock()
        self._sub: Subscription | None = None
        self._ticker: asyncio.Task | None = None
        self._busy = False
        self._since = time.monotonic()
        self._show(registration.entry.role)
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
        subject = self._names.ctl_role(self._registration.worker_id)
        self._sub = await self._nc.subscribe(subject, cb=self._on_request)
        await self._nc.flush()  # the server knows the subscription before anyone is told
        self._ticker = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
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
        try:
            if request.role is not self.role:
                await self._switch(request.role)
        except Exception as exc:  # the worker keeps its role; the scheduler decides what next
            ROLE_CHANGES.labels("failed").inc()
            log.error(kv("role_change_failed", role=request.role, epoch=request.epoch, error=exc))
            await self._reply(msg, self.role, self.epoch, False, f"switch failed: {exc!r}")
            return
        seconds = time.monotonic() - received
        if seconds > request.deadline_s:
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
        self.account()
        self._busy = False
        self._show(role)
        await self._registration.put(role=role, epoch=epoch, busy=False)

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
    """A process's membership of the run: take the entry's role (``switch``), write the entry,
    serve role-change requests, renew the entry every ``heartbeat_s``. On the way out, normal or
    not: stop the heartbeats, stop the role requests, delete the entry, in that order, each step
    taken even if one before it raised."""
    async with contextlib.AsyncExitStack() as leave:  # runs its callbacks last-in, first-out
        await switch(registration.entry.role)
        # A process joining while JetStream cannot answer (leaders moving after an outage) waits
        # for it to register, rather than exiting.
        await retry(registration.put, what="registration")
        leave.push_async_callback(registration.delete)
        roles = RoleHolder(nc, names, registration, switch)
        leave.push_async_callback(roles.stop)
        await roles.start()
        heartbeat = asyncio.create_task(registration.keep_alive(heartbeat_s))
        leave.push_async_callback(_cancel, heartbeat)
        yield roles


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
