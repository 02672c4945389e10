"""Authorization on a live nats-server (each binary found): every cell of the permission matrix
(``broker.permissions``), JetStream least privilege, private replies, and runs as tenants."""

import asyncio
import contextlib
import os
from pathlib import Path

import nats
import pytest
from nats.js.api import ConsumerConfig, StreamConfig
from nats.js.errors import BadRequestError

from broker.auth import Identity
from broker.client import session
from broker.config import MiB
from broker.exceptions import AuthorizationError, IdentityError
from broker.messages import TaskSubmitted
from broker.permissions import Principal, inbox_prefix, matrix_markdown, rows
from broker.server import EmbeddedBroker
from broker.subjects import Durable, RunNames
from seamlessflow.submit import submit_tasks
from tests.support import SECURE_LIMITS, secure_run

RUN, OTHER = "permA", "permB"
PROBE_WAIT_S = 0.5


@pytest.fixture(scope="module")
def secure(broker: EmbeddedBroker) -> EmbeddedBroker:
    """The secured broker with run ``RUN`` provisioned by its admin."""
    asyncio.run(secure_run(broker, RUN))
    return broker


def as_(broker: EmbeddedBroker, run: str, principal: Principal, **kwargs):
    path = broker.authority.path(run, principal)
    return session(broker.url, f"test-{principal}", identity_file=path, **kwargs)


def concrete(pattern: str) -> str:
    """A subject the pattern matches: ``*`` -> one token, ``>`` -> two."""
    return ".".join({"*": "x1", ">": "x1.x2"}.get(t, t) for t in pattern.split("."))


def matches(pattern: str, subject: str) -> bool:
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or token not in ("*", have[i]):
            return False
    return len(want) == len(have)


def violations(errors: list[str], kind: str) -> set[str]:
    """Subjects the server refused (``kind``: publish or subscription), from its -ERRs, lower
    case (as nats-py reports them)."""
    marker = f"permissions violation for {kind} to "
    return {e.lower().split(marker, 1)[1].strip().strip('"') for e in errors if marker in e.lower()}


class Probe:
    """The server's errors to one connection (``probing``)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def error_cb(self, exc: Exception) -> None:
        self.errors.append(str(exc))


@contextlib.asynccontextmanager
async def probing(broker: EmbeddedBroker, run: str, principal: Principal):
    """A plain nats-py connection as ``principal`` of ``run`` whose server errors (permission
    violations) are recorded in the ``Probe`` it yields with it."""
    probe = Probe()
    identity = Identity.load(broker.authority.path(run, principal))
    nc = await nats.connect(
        broker.url, error_cb=probe.error_cb, allow_reconnect=False, **identity.connect_options()
    )
    try:
        yield nc, probe
    finally:
        await nc.close()


async def test_every_cell_of_the_matrix_is_enforced_by_the_server(secure: EmbeddedBroker):
    names = RunNames(RUN)
    table = rows(names)
    subjects = [concrete(r.subject) for r in table]
    inboxes = {p: f"{inbox_prefix(RUN, p)}.x1" for p in Principal}
    cells = 0
    async with as_(secure, RUN, Principal.ADMIN) as admin:
        seen: list[str] = []

        async def record(msg) -> None:
            seen.append(msg.subject)

        await admin.subscribe(">", cb=record)
        await admin.flush()
        for principal in Principal:
            if principal is Principal.ADMIN:
                continue
            pub_ok = [r.subject for r in table if principal in r.pub]
            sub_ok = [r.subject for r in table if principal in r.sub]
            sub_ok.append(f"{inbox_prefix(RUN, principal)}.>")
            async with probing(secure, RUN, principal) as (nc, probe):
                # publish: every subject of the matrix
                seen.clear()
                for subject in subjects:
                    await nc.publish(subject, b"probe")
                await nc.flush()
                await asyncio.sleep(PROBE_WAIT_S)
                refused = violations(probe.errors, "publish")
                for row, subject in zip(table, subjects, strict=True):
                    allowed = any(matches(p, subject) for p in pub_ok)
                    assert allowed == (subject.lower() not in refused), (principal, "pub", subject)
                    assert allowed == (subject in seen), (principal, "pub arrives", subject)
                    if principal in row.pub:
                        assert allowed, (principal, row)
                cells += len(subjects)
                # subscribe: every subject of the matrix and every principal's inbox
                targets = [*subjects, *inboxes.values()]
                got: dict[str, int] = {}

                async def count(msg, got=got) -> None:
                    got[msg.subject] = got.get(msg.subject, 0) + 1

                for subject in targets:
                    await nc.subscribe(subject, cb=count)
                await nc.flush()
                await asyncio.sleep(PROBE_WAIT_S)
                for subject in targets:
                    await admin.publish(subject, b"probe")
                await admin.flush()
                await asyncio.sleep(PROBE_WAIT_S)
                refused = violations(probe.errors, "subscription")
                for subject in targets:
                    allowed = any(matches(p, subject) for p in sub_ok)
                    assert allowed == (subject.lower() not in refused), (principal, "sub", subject)
                    assert allowed == (subject in got), (principal, "sub receives", subject)
                cells += len(targets)
    print(f"permission matrix: {cells} cells checked against the server")
    assert cells >= 8 * (2 * len(table) + len(inboxes))


async def test_jetstream_least_privilege(secure: EmbeddedBroker):
    names = RunNames(RUN)
    async with probing(secure, RUN, Principal.WORKER) as (worker, probe):
        js = worker.jetstream(timeout=1.0)
        for config in (
            ConsumerConfig(durable_name="mine"),
            ConsumerConfig(deliver_subject=f"{inbox_prefix(RUN, Principal.WORKER)}.push"),
        ):
            with pytest.raises(Exception):  # noqa: B017 - refused: the request is never answered
                await js.add_consumer(names.samples_stream, config)
        with pytest.raises(Exception):  # noqa: B017
            await js.get_msg(names.samples_stream, 1)
        sub = await js.pull_subscribe_bind(Durable.TRAINER, names.samples_stream)
        with pytest.raises(Exception):  # noqa: B017 - another service's durable
            await sub.fetch(1, timeout=1.0)
        await worker.publish(names.weights, b"forged")
        await worker.publish(names.samples, b"forged")
        await worker.flush()
        await asyncio.sleep(PROBE_WAIT_S)
        assert {names.weights.lower(), names.samples.lower()} <= violations(probe.errors, "publish")
        # its own durable works (the matrix test may have left a request in it)
        own = await js.pull_subscribe_bind(Durable.ROLLOUT, names.gen_stream)
        with contextlib.suppress(TimeoutError):
            await own.fetch(1, timeout=0.5)
        assert not any(
            "consumer.msg.next" in e.lower() and "gen" in e.lower() for e in probe.errors
        )
    # only the trainer writes the weights object store
    for principal in Principal:
        if principal in (Principal.ADMIN, Principal.TRAINER):
            continue
        async with as_(secure, RUN, principal) as nc:
            js = nc.jetstream(timeout=1.0)
            with pytest.raises(Exception):  # noqa: B017
                store = await js.object_store(names.weights_store)
                await store.put("forged", b"x" * 10)
    async with as_(secure, RUN, Principal.TRAINER) as trainer:
        store = await trainer.jetstream(timeout=5.0).object_store(names.weights_store)
        assert (await store.put("probe", b"x" * 10)).size == 10
    # a task client submits (as `seamlessflow submit` does) and does nothing else
    async with probing(secure, RUN, Principal.CLIENT) as (client, probe):
        task = TaskSubmitted(task_id="probe", messages=[{"role": "user", "content": "1+1?"}])
        report = await submit_tasks(client.jetstream(timeout=2.0), names, [task], progress=False)
        assert report.published == 1, report
        for subject in (names.traj_end, names.traj_calls("s1"), names.gen_req):
            await client.publish(subject, b"forged")
        await client.flush()
        await asyncio.sleep(PROBE_WAIT_S)
        forged = {names.traj_end, names.traj_calls("s1"), names.gen_req}
        assert {s.lower() for s in forged} <= violations(probe.errors, "publish")


async def test_anonymous_foreign_and_loose_identities_are_refused(
    secure: EmbeddedBroker, tmp_path: Path
):
    with pytest.raises(AuthorizationError, match="no identity"):
        async with session(secure.url, "anonymous"):
            pass
    stranger = Identity.new(RUN, Principal.ADMIN).save(tmp_path / "stranger.toml")
    with pytest.raises(AuthorizationError, match=r"stranger\.toml"):
        async with session(secure.url, "stranger", identity_file=stranger):
            pass
    loose = Identity.new(RUN, Principal.ADMIN).save(tmp_path / "loose.toml")
    os.chmod(loose, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        async with session(secure.url, "loose", identity_file=loose):
            pass
    assert stranger.stat().st_mode & 0o777 == 0o600


async def test_runs_are_tenants_with_their_own_limits(secure: EmbeddedBroker):
    secure.authority.issue_run(OTHER)
    await asyncio.to_thread(secure.reload)
    a = RunNames(RUN)
    async with (
        as_(secure, RUN, Principal.ADMIN) as admin_a,
        as_(secure, OTHER, Principal.ADMIN) as admin_b,
    ):
        seen_by_b: list[str] = []

        async def record(msg) -> None:
            seen_by_b.append(msg.subject)

        await admin_b.subscribe(">", cb=record)
        js_a, js_b = admin_a.jetstream(), admin_b.jetstream()
        await js_a.publish(a.tasks, b"{}")
        await admin_a.publish(a.gen_out("c1"), b"tokens")
        await admin_a.flush()
        await asyncio.sleep(PROBE_WAIT_S)
        assert seen_by_b == []
        assert [s for s in await js_b.streams_info() if s.config.name.startswith(f"SF_{RUN}")] == []
        # a runaway run B fills its own account; run A keeps working
        await js_b.add_stream(StreamConfig(name="RUNAWAY", subjects=["runaway"]))
        refused = None
        for i in range(200):
            try:
                await js_b.publish("runaway", os.urandom(MiB), timeout=5)
            except BadRequestError as exc:  # the account is full
                refused = (i, exc)
                break
        assert refused is not None and refused[0] * MiB <= SECURE_LIMITS.max_file
        ack = await js_a.publish(a.tasks, b"{}")
        assert ack.stream == a.tasks_stream
        await js_b.delete_stream("RUNAWAY")


async def test_a_worker_holds_only_its_principals_rights(secure: EmbeddedBroker):
    """A worker process connects as ``worker`` (rollout only) unless it is tagged train
    (``seamlessflow.run``): as ``worker`` it can never publish weights, whatever role the
    scheduler gives it."""
    names = RunNames(RUN)
    async with probing(secure, RUN, Principal.WORKER) as (worker, probe):
        await worker.publish(names.weights, b"v999")
        await worker.publish(f"$O.{names.weights_store}.M.x", b"meta")
        await worker.flush()
        await asyncio.sleep(PROBE_WAIT_S)
        assert len(violations(probe.errors, "publish")) == 2


def test_the_protocol_document_prints_the_matrix_in_force():
    protocol = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    assert matrix_markdown(RunNames("quickstart")) in protocol
