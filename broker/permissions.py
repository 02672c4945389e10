"""Who may publish and subscribe to what in one run: the permission matrix, from the same names
as every subject (``broker.subjects``). Nobody else writes a permission.

The NATS server enforces it (``broker.auth`` renders each principal's rights into the server's
configuration): a row is one subject pattern of a run, with the principals that may publish to
it and those that may subscribe to it. A principal's rights are the union of its rows, plus its
own inbox (``inbox_prefix``) and, for the services that answer requests, replies to what it
received (``allow_responses``). ``ADMIN`` holds everything in its run's account: it provisions
the streams and consumers, and the launcher uses it to watch the run.

JetStream is reached through subjects too (``$JS.API.>``, ``$JS.ACK.>``, ``$KV.>``, ``$O.>``), so
the same rows say that only the admin creates streams and durable consumers, that each service
may fetch from and ack only its own durable consumer, and that only the trainer writes the
weights object store. ``docs/protocol.md`` prints this table (``matrix_markdown``).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from broker.subjects import Durable, RunNames


class Principal(StrEnum):
    """One identity per process role of a run."""

    SCHEDULER = "scheduler"
    WORKER = "worker"  # a rollout worker
    TRAINER = "trainer"  # the trainer, or a worker tagged train (it may train and roll out)
    TRAJECTORY = "trajectory"
    GATEWAY = "gateway"
    AGENTS = "agents"  # the agent runner
    CLIENT = "client"  # submits tasks, nothing else
    OBSERVER = "observer"  # status, stream depths, dead letters
    ADMIN = "admin"  # provisioning; the launcher


S, W, T, J, G, A, C, V = (
    Principal.SCHEDULER,
    Principal.WORKER,
    Principal.TRAINER,
    Principal.TRAJECTORY,
    Principal.GATEWAY,
    Principal.AGENTS,
    Principal.CLIENT,
    Principal.OBSERVER,
)
RESPONDERS = frozenset({W, T})
"""They answer requests (role changes) on the requester's inbox, whatever its prefix."""


@dataclass(frozen=True)
class Row:
    """A subject pattern and who may publish to / subscribe to it."""

    subject: str
    what: str
    pub: frozenset[Principal] = frozenset()
    sub: frozenset[Principal] = frozenset()


def inbox_prefix(run: str, principal: Principal) -> str:
    """Where a principal's replies (requests, JetStream API answers, push consumers) arrive:
    nobody else may subscribe there."""
    return f"_INBOX.{run}.{principal.value}"


def _api(verb: str) -> str:
    return f"$JS.API.{verb}"


def rows(names: RunNames) -> list[Row]:
    """The run's permission matrix."""
    n = names
    everyone = frozenset(Principal) - {Principal.ADMIN}
    kv = {b: f"KV_{b}" for b in (n.workers_kv, n.control_kv, n.state_kv)}
    obj = f"OBJ_{n.weights_store}"
    table = [
        # -- the data plane --------------------------------------------------------------------
        Row(n.tasks, "submit a task", pub=frozenset({C})),
        Row(n.tasks_admitted, "an admitted task", pub=frozenset({S})),
        Row(n.gen_req, "a generation request", pub=frozenset({G})),
        Row(n.gen_out_all, "a call's token stream", pub=frozenset({W, T}), sub=frozenset({G})),
        Row(n.gen_cancel_all, "cancel a call", pub=frozenset({G}), sub=frozenset({W, T})),
        Row(n.traj_calls_all, "a session's call record", pub=frozenset({G})),
        Row(n.gw_unavailable_all, "a call not served now", pub=frozenset({G}), sub=frozenset({A})),
        Row(n.traj_end, "a session's end and rewards", pub=frozenset({A})),
        Row(n.samples, "a trained sample", pub=frozenset({J})),
        Row(n.weights, "a weights version", pub=frozenset({T})),
        Row(n.ctl_role_all, "a role change", pub=frozenset({S}), sub=frozenset({W, T})),
        Row(n.dead_all, "a dead letter", pub=frozenset({S, W, T, J, A})),
        # -- key-value buckets and the weights object store ------------------------------------
        Row(f"$KV.{n.workers_kv}.>", "the worker registry", pub=frozenset({S, W, T})),
        Row(f"$KV.{n.control_kv}.>", "the scheduler lease", pub=frozenset({S})),
        Row(f"$KV.{n.state_kv}.>", "control-plane state", pub=frozenset({S, T})),
        Row(f"$O.{n.weights_store}.>", "weights bytes", pub=frozenset({T})),
        # -- JetStream: provisioning is the admin's --------------------------------------------
        Row(_api("STREAM.CREATE.*"), "create a stream"),
        Row(_api("STREAM.UPDATE.*"), "change a stream"),
        Row(_api("STREAM.DELETE.*"), "delete a stream"),
        Row(_api("STREAM.PURGE.*"), "purge a stream"),
        Row(_api("CONSUMER.DURABLE.CREATE.*.*"), "create a durable consumer"),
        Row(_api("CONSUMER.DELETE.*.*"), "delete a consumer"),
        Row(_api(f"CONSUMER.CREATE.{n.samples_stream}"), "create a consumer on samples"),
        Row(_api("INFO"), "account info", pub=frozenset({V})),
        # nats-py's object store lists (the trainer's pruning) through an unbound subscribe
        Row(_api("STREAM.NAMES"), "list streams", pub=frozenset({T, V})),
        Row(_api("STREAM.LIST"), "list streams with info", pub=frozenset({V})),
        Row(_api("STREAM.INFO.*"), "a stream's info", pub=everyone - {C}),
        # seamlessflow submit checks that the run is provisioned before it publishes
        Row(_api(f"STREAM.INFO.{n.tasks_stream}"), "the tasks stream's info", pub=frozenset({C})),
        Row(_api("CONSUMER.INFO.*.*"), "any consumer's info", pub=frozenset({V})),
        Row(_api("CONSUMER.LIST.*"), "list consumers", pub=frozenset({V})),
        Row(_api(f"STREAM.MSG.GET.{n.dead_stream}"), "read a dead letter", pub=frozenset({V})),
        Row(_api(f"STREAM.MSG.GET.{n.traj_stream}"), "read a call record", pub=frozenset({J})),
        Row(
            _api(f"STREAM.MSG.GET.{n.gen_stream}"),
            "is a request still queued",
            pub=frozenset({G}),
        ),
        Row(
            _api(f"STREAM.MSG.DELETE.{n.gen_stream}"),
            "withdraw a cancelled request",
            pub=frozenset({G}),
        ),
        Row(
            _api(f"STREAM.MSG.GET.{n.weights_stream}"),
            "read the latest weights event",
            pub=frozenset({W, T, S, V}),
        ),
        # weights events: an ordered push consumer per rollout worker
        Row(_api(f"CONSUMER.CREATE.{n.weights_stream}"), "follow weights", pub=frozenset({W, T})),
        Row(
            _api(f"CONSUMER.CREATE.{n.weights_stream}.>"),
            "follow weights (2.10+)",
            pub=frozenset({W, T}),
        ),
        Row(
            _api(f"CONSUMER.INFO.{n.weights_stream}.*"), "a weights follower", pub=frozenset({W, T})
        ),
        Row(f"$JS.FC.{n.weights_stream}.>", "flow control", pub=frozenset({W, T})),
        # the weights object store: written by the trainer only, read by every worker
        Row(_api(f"STREAM.PURGE.{obj}"), "drop old weights", pub=frozenset({T})),
        Row(_api(f"STREAM.MSG.GET.{obj}"), "weights metadata", pub=frozenset({W, T})),
        Row(_api(f"DIRECT.GET.{obj}.>"), "weights metadata (direct)", pub=frozenset({W, T})),
        Row(_api(f"CONSUMER.CREATE.{obj}"), "read weights", pub=frozenset({W, T})),
        Row(_api(f"CONSUMER.CREATE.{obj}.>"), "read weights (2.10+)", pub=frozenset({W, T})),
        Row(_api(f"CONSUMER.MSG.NEXT.{obj}.*"), "read weights chunks", pub=frozenset({W, T})),
        Row(_api(f"CONSUMER.INFO.{obj}.*"), "a weights read", pub=frozenset({W, T})),
        Row(_api(f"CONSUMER.DELETE.{obj}.*"), "end a weights read", pub=frozenset({W, T})),
    ]
    # each durable consumer: fetched and acked by its own service only
    for stream, durable, principals in (
        (n.tasks_stream, Durable.SCHEDULER, {S}),
        (n.tasks_stream, Durable.AGENTS, {A}),
        (n.gen_stream, Durable.ROLLOUT, {W, T}),
        (n.traj_stream, Durable.TRAJECTORY, {J}),
        (n.samples_stream, Durable.TRAINER, {T}),
    ):
        table += [
            Row(
                _api(f"CONSUMER.INFO.{stream}.{durable}"),
                f"{durable}'s info",
                pub=frozenset({*principals, S, V}),
            ),
            Row(
                _api(f"CONSUMER.MSG.NEXT.{stream}.{durable}"),
                f"fetch from {durable}",
                pub=frozenset(principals),
            ),
            Row(f"$JS.ACK.{stream}.{durable}.>", f"ack {durable}", pub=frozenset(principals)),
        ]
    # buckets: read and watched by those who need them
    readers = {
        n.workers_kv: {S, W, T, V},
        n.control_kv: {S, W, T, V},
        n.state_kv: {S, W, T, V},
    }
    for bucket, stream in kv.items():
        who = frozenset(readers[bucket])
        table += [
            Row(_api(f"STREAM.MSG.GET.{stream}"), f"read {bucket}", pub=who),
            Row(_api(f"DIRECT.GET.{stream}"), f"read {bucket} (direct)", pub=who),
            Row(_api(f"DIRECT.GET.{stream}.>"), f"read a key of {bucket}", pub=who),
            Row(_api(f"CONSUMER.CREATE.{stream}"), f"watch {bucket}", pub=who),
            Row(_api(f"CONSUMER.CREATE.{stream}.>"), f"watch {bucket} (2.10+)", pub=who),
            Row(_api(f"CONSUMER.INFO.{stream}.*"), f"a watch of {bucket}", pub=who),
            Row(_api(f"CONSUMER.DELETE.{stream}.*"), f"stop watching {bucket}", pub=who),
            Row(f"$JS.FC.{stream}.>", f"flow control of {bucket}", pub=who),
        ]
    return table


@dataclass(frozen=True)
class Rights:
    """What the server lets one principal do: NATS ``permissions`` of a user."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool

    def nats(self) -> dict:
        """As ``permissions`` in nats-server's configuration."""
        rights: dict = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            rights["allow_responses"] = True
        return rights


def rights(names: RunNames, principal: Principal) -> Rights | None:
    """``principal``'s rights in ``names``'s run; None (everything in its account) for the
    admin."""
    if principal is Principal.ADMIN:
        return None
    table = rows(names)
    inbox = f"{inbox_prefix(names.run, principal)}.>"
    return Rights(
        publish=_unique(r.subject for r in table if principal in r.pub),
        subscribe=_unique([*(r.subject for r in table if principal in r.sub), inbox]),
        allow_responses=principal in RESPONDERS,
    )


def _unique(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def matrix_markdown(names: RunNames) -> str:
    """The matrix as a Markdown table (``docs/protocol.md``): P publishes, S subscribes."""
    roles = [p for p in Principal if p is not Principal.ADMIN]
    lines = [
        "| subject | what | " + " | ".join(p.value for p in roles) + " |",
        "|---|---|" + "---|" * len(roles),
    ]
    for row in rows(names):
        cells = [("P" if p in row.pub else "") + ("S" if p in row.sub else "") for p in roles]
        lines.append(f"| `{row.subject}` | {row.what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
