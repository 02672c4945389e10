"""Every subject, stream, consumer and bucket name of a run, and the session header's name.
Nobody else formats one.

All subjects of run ``r`` live under ``sf.r.`` so several runs share one NATS cluster; stream
names are ``SF_r_<PART>`` and buckets ``sf-r-<part>``. ``docs/protocol.md`` lists them for
clients in other languages.
"""

import re
from dataclasses import dataclass
from enum import StrEnum

from broker.exceptions import InvalidNameError

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""Run, worker, call and session ids: one subject token, usable in stream and bucket names."""
_NAME = re.compile(NAME_PATTERN)

SESSION_HEADER = "X-Session-Id"
"""The HTTP header that ties an agent's calls to the gateway into one session (else the
request's ``user`` field); its value is a session id (``NAME_PATTERN``)."""

TASK_HEADER = "X-Task-Id"
"""The HTTP header an agent runner's attempt sends with every call: the admitted task's id. The
gateway counts calls without it as ``direct`` (a client driving the gateway itself, outside
admission until its session ends: ``tagsched.admission``)."""


def check_name(kind: str, name: str) -> str:
    """Return ``name`` if it can be one token of a subject and part of a stream/bucket name."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidNameError(
            f"{kind} name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-'"
        )
    return name


@dataclass(frozen=True)
class RunNames:
    """The names of one run's subjects, streams, durable consumers and buckets."""

    run: str

    def __post_init__(self) -> None:
        check_name("run", self.run)

    # -- subjects -------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"sf.{self.run}"

    @property
    def tasks(self) -> str:
        """Task submissions from any client (work queue)."""
        return f"{self.prefix}.tasks"

    @property
    def tasks_admitted(self) -> str:
        """Tasks the scheduler admitted, scheduler -> agent runners (work queue, same stream)."""
        return f"{self.prefix}.tasks.admitted"

    @property
    def gen_req(self) -> str:
        """Generation requests, gateway -> rollout workers (work queue)."""
        return f"{self.prefix}.gen.req"

    def gen_out(self, call_id: str) -> str:
        """Streamed token chunks of one call, rollout worker -> gateway (core NATS)."""
        return f"{self.prefix}.gen.out.{check_name('call', call_id)}"

    @property
    def gen_out_all(self) -> str:
        return f"{self.prefix}.gen.out.*"

    def gen_cancel(self, call_id: str) -> str:
        """Cancellation of one call's generation, gateway -> rollout workers (core NATS)."""
        return f"{self.prefix}.gen.cancel.{check_name('call', call_id)}"

    @property
    def gen_cancel_all(self) -> str:
        return f"{self.prefix}.gen.cancel.*"

    def traj_calls(self, session_id: str) -> str:
        """One session's call records, gateway -> trajectory manager (stream). A subject per
        session lets the manager read back any session's calls from the stream alone."""
        return f"{self.prefix}.traj.calls.{check_name('session', session_id)}"

    @property
    def traj_calls_all(self) -> str:
        return f"{self.prefix}.traj.calls.*"

    def gw_unavailable(self, session_id: str) -> str:
        """A call of the session the gateway could not serve, gateway -> agent runner (core
        NATS): an outage the agent's own client reports its own way, told apart from its
        failure."""
        return f"{self.prefix}.gw.unavailable.{check_name('session', session_id)}"

    @property
    def gw_unavailable_all(self) -> str:
        return f"{self.prefix}.gw.unavailable.*"

    @property
    def traj_end(self) -> str:
        return f"{self.prefix}.traj.end"

    @property
    def samples(self) -> str:
        return f"{self.prefix}.samples"

    @property
    def weights(self) -> str:
        return f"{self.prefix}.weights"

    def ctl_role(self, worker_id: str) -> str:
        """Role changes for one worker, scheduler -> worker (core request/reply)."""
        return f"{self.prefix}.ctl.role.{check_name('worker', worker_id)}"

    @property
    def ctl_role_all(self) -> str:
        return f"{self.prefix}.ctl.role.*"

    def dead(self, source: str) -> str:
        """Dead letters of messages rejected at the ingress named ``source``."""
        return f"{self.prefix}.dead.{check_name('source', source)}"

    @property
    def dead_all(self) -> str:
        return f"{self.prefix}.dead.>"

    # -- streams --------------------------------------------------------------------------
    def stream(self, part: str) -> str:
        return f"SF_{self.run}_{part.upper()}"

    @property
    def tasks_stream(self) -> str:
        return self.stream("tasks")

    @property
    def gen_stream(self) -> str:
        return self.stream("gen")

    @property
    def traj_stream(self) -> str:
        return self.stream("traj")

    @property
    def samples_stream(self) -> str:
        return self.stream("samples")

    @property
    def weights_stream(self) -> str:
        return self.stream("weights")

    @property
    def dead_stream(self) -> str:
        return self.stream("dead")

    # -- buckets --------------------------------------------------------------------------
    @property
    def workers_kv(self) -> str:
        return f"sf-{self.run}-workers"

    @property
    def control_kv(self) -> str:
        """The scheduler's lease (key ``scheduler``): one active scheduler per run."""
        return f"sf-{self.run}-control"

    @property
    def state_kv(self) -> str:
        """The control plane's durable state (no TTL): what must outlive the scheduler holding
        the lease, for the one that takes over (``docs/protocol.md`` lists its keys)."""
        return f"sf-{self.run}-state"

    SCHEDULER_STATE_KEY = "scheduler"
    """``state_kv`` key: the scheduler's epochs, fences, switch costs and group sizes
    (``SchedulerState``), written by the scheduler leading, read by its successor and workers."""
    TRAINER_GROUP_KEY = "trainer-group"
    """``state_kv`` key: the trainer group (``TrainerGroup``), written by the scheduler."""
    TRAINER_RENDEZVOUS_KEY = "trainer-rendezvous"
    """``state_kv`` key: where the group's ranks meet (``TrainerRendezvous``), by its rank 0."""

    @property
    def weights_store(self) -> str:
        return f"sf-{self.run}-weights"


class Durable(StrEnum):
    """Durable pull-consumer names, one per consuming role."""

    SCHEDULER = "scheduler"  # tasks -> scheduler (admission)
    AGENTS = "agents"  # tasks.admitted -> agent runner
    ROLLOUT = "rollout"  # gen.req -> rollout workers
    TRAJECTORY = "trajectory"  # traj.end -> trajectory manager (reads traj.calls.<session>)
    TRAINER = "trainer"  # samples -> trainer
