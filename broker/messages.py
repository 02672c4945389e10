"""Every message that crosses the data plane, in one place (the control plane's are apart: a
worker's registry entry and role changes in ``broker.worker_messages``, the durable state records
kept in the run's state bucket in ``broker.control``).

Each message is a frozen, strictly typed model named for what happened or is asked. Its comment
gives the direction and the subject (see ``broker.subjects``). Rules that keep clients in other
languages working:

- ``schema_version`` is the first field of every message; receivers reject versions they do not
  know. Fields are only ever added at the end, with defaults, within a version.
- Types are strict: a string is never read as a number, a float never as an int. Unknown fields
  are rejected, so a typo in a foreign client fails loudly instead of being dropped.
- Only ``broker.codec`` turns these into bytes and back.
"""

from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.subjects import NAME_PATTERN

SCHEMA_VERSION = 1

Id = Annotated[str, Field(pattern=NAME_PATTERN)]
"""An id that may appear in a subject token or a bucket key."""

MAX_SAFE_INT = 2**53
"""Integers stay below this so JavaScript clients read them exactly."""

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Count = Annotated[int, Field(ge=0, lt=MAX_SAFE_INT)]
Version = Count
REASON_MAX = 8192
HEADER_MAX = 256

Timestamp = Annotated[float, Field(ge=0)]
"""Seconds since the Unix epoch."""

Seconds = Annotated[float, Field(ge=0)]
"""A duration."""


CALLABLE_REF = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
"""``package.module:function`` (ASCII names: a wire pattern every schema validator reads alike)."""


class Message(BaseModel):
    """Base of every wire message."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    schema_version: Literal[1] = SCHEMA_VERSION


class Role(StrEnum):
    """What a worker process is doing now."""

    IDLE = "idle"
    ROLLOUT = "rollout"
    TRAIN = "train"


class WeightsState(StrEnum):
    """Where a worker stands in the weight rhythm (``rollout.following``)."""

    READY = "ready"
    """Serving the version it holds; no newer one pending."""
    WAITING = "waiting"
    """A newer version is fetched or waits for its wave; still serving the old one."""
    LOADING = "loading"
    """The engine is paused, loading a version: its capacity is out."""


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# Enums arrive as strings on the wire; they are still checked against the allowed values.
RoleField = Annotated[Role, Field(strict=False)]
FinishReasonField = Annotated[FinishReason, Field(strict=False)]
WeightsStateField = Annotated[WeightsState, Field(strict=False)]


class FunctionCall(BaseModel):
    model_config = Message.model_config

    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1 << 20, description="JSON text, as OpenAI sends it")


class ToolCall(BaseModel):
    model_config = Message.model_config

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One OpenAI-style chat message."""

    model_config = Message.model_config

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(default="", max_length=1 << 20)
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] = Field(default_factory=list, max_length=128)


class RewardSpec(BaseModel):
    """How a finished attempt at a task is scored."""

    model_config = Message.model_config

    verifier: str = Field(
        default="exact_match", min_length=1, max_length=128, description="verifier name"
    )
    reference: str | None = Field(
        default=None, max_length=1 << 16, description="the expected answer, if any"
    )
    function: str | None = Field(
        default=None,
        pattern=CALLABLE_REF,
        max_length=256,
        description="'module:function', a reward function given the attempt's transcript and "
        "the task; it scores instead of the verifier (its module must be allowed by the agent "
        "runner's agents.reward_modules)",
    )


class Admitted(BaseModel):
    """Where the scheduler admitted a task: set on its admitted copy, carried by its sessions'
    ``SessionEnded`` and their samples, so the trainer trains in admission order
    (``trainer.order``)."""

    model_config = Message.model_config

    ticket: int = Field(ge=1, lt=MAX_SAFE_INT, description="1, 2, ... in admission order")
    version: Version = Field(
        description="the oldest weight version a rollout worker served then: no token of the "
        "task's sessions is older"
    )
    at: Timestamp | None = Field(
        default=None,
        description="the scheduler's clock at admission (Unix seconds): how long a task takes to "
        "reach its first call (``seamlessflow plan``'s costs)",
    )
    since: int | None = Field(
        default=None,
        ge=1,
        lt=MAX_SAFE_INT,
        description="a ticket from which on, up to this one, every ticket was stamped at this "
        "version (the first this scheduler stamped at it): the trainer knows a missing ticket's "
        "version before any of its samples arrives (``trainer.order``)",
    )

    @model_validator(mode="after")
    def _since_not_above(self) -> Self:
        if self.since is not None and self.since > self.ticket:
            raise ValueError(f"since {self.since} is above the ticket {self.ticket}")
        return self


class TaskSubmitted(Message):
    """A task to run agents on. # any client -> agent runner, on ``sf.<run>.tasks``."""

    task_id: Id = Field(description="unique per run; also the JetStream Nats-Msg-Id")
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    env: str = Field(default="chat", min_length=1, max_length=128, description="environment name")
    reward: RewardSpec = Field(default_factory=RewardSpec)
    group_size: int = Field(default=1, ge=1, le=1024, description="attempts per task")
    max_turns: int = Field(default=1, ge=1, le=1024)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    admitted: Admitted | None = Field(
        default=None, description="set by the scheduler on the admitted copy, replacing a client's"
    )


class SamplingParams(BaseModel):
    model_config = Message.model_config

    max_tokens: int = Field(default=256, ge=1, le=1 << 20)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, lt=MAX_SAFE_INT, description="-1: no top-k")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=256)
    seed: int | None = Field(default=None, ge=0, lt=MAX_SAFE_INT)


class GenerationRequested(Message):
    """Generate from token ids. # gateway -> rollout worker, on ``sf.<run>.gen.req``.

    A continuation after an interruption (weight update, worker death) carries the tokens
    generated so far at the end of ``prompt_ids`` and counts them in ``resumed_tokens``.
    """

    call_id: Id
    session_id: Id
    attempt: int = Field(
        default=0, ge=0, lt=MAX_SAFE_INT, description="0, then +1 per continuation"
    )
    model: str = Field(min_length=1, max_length=256)
    prompt_ids: list[TokenId] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    reply_to: str = Field(min_length=1, max_length=512, description="subject for TokensGenerated")
    resumed_tokens: int = Field(default=0, ge=0, lt=MAX_SAFE_INT)
    streamed: bool = Field(
        default=True,
        description="false: the requester reads only the whole response, so the worker holds "
        "the tokens and sends them with the finish (or a keepalive) instead of every "
        "stream_interval_s",
    )


class TokensGenerated(Message):
    """A chunk of generated tokens. # rollout worker -> gateway, on the request's ``reply_to``."""

    call_id: Id
    attempt: int = Field(ge=0, lt=MAX_SAFE_INT)
    seq: int = Field(ge=0, lt=MAX_SAFE_INT, description="chunk number within the attempt, from 0")
    worker_id: Id
    version: Version = Field(description="weight version that produced these tokens")
    token_ids: list[TokenId] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list, description="one per token")
    finish_reason: FinishReasonField | None = None
    error: str | None = Field(default=None, max_length=4096)
    engine_s: Seconds | None = Field(
        default=None,
        description="on the chunk that ends the attempt: seconds from the worker's call into its "
        "engine to the engine's last chunk",
    )

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> Self:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"{len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs: "
                "need one logprob per token"
            )
        return self


class GenerationCancelled(Message):
    """Stop generating this call. # gateway -> rollout workers,
    on ``sf.<run>.gen.cancel.<call>`` (core NATS). The worker holding ``attempt`` aborts it; an
    attempt it does not hold is ignored."""

    call_id: Id
    attempt: int = Field(ge=0, lt=MAX_SAFE_INT)
    reason: str = Field(default="", max_length=1024)


class CallRecorded(Message):
    """One finished LLM call, token-exact. # gateway -> trajectory manager,
    on ``sf.<run>.traj.calls.<session_id>``."""

    session_id: Id
    call_id: Id
    model: str = Field(min_length=1, max_length=256)
    prompt_ids: list[TokenId] = Field(min_length=1)
    output_ids: list[TokenId] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list)
    output_versions: list[Version] = Field(default_factory=list)
    finish_reason: FinishReasonField
    started_at: Timestamp
    finished_at: Timestamp
    interruptions: int = Field(default=0, ge=0, lt=MAX_SAFE_INT)
    engine_s: Seconds | None = Field(
        default=None,
        description="the engines' seconds on the call (``TokensGenerated.engine_s`` summed over "
        "its attempts); the rest of finished_at - started_at is the data plane's. None: no "
        "attempt told it",
    )

    @property
    def added_s(self) -> float | None:
        """What the data plane added to the call: its duration less the engines' seconds on it;
        None when no attempt told them."""
        if self.engine_s is None:
            return None
        return self.finished_at - self.started_at - self.engine_s

    @model_validator(mode="after")
    def _per_token_lists_align(self) -> Self:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"{n} output_ids, {len(self.output_logprobs)} output_logprobs and "
                f"{len(self.output_versions)} output_versions: all must have one entry per token"
            )
        return self


class CallUnavailable(Message):
    """The gateway could not serve a call of this session (answered 503: no rollout worker
    took it within ``queue_timeout_s``, its attempts ran out, or its record could not be
    stored). # gateway -> agent runner, core NATS on ``sf.<run>.gw.unavailable.<session_id>``."""

    session_id: Id
    call_id: Id
    reason: str = Field(default="", max_length=1024)


class SessionEnded(Message):
    """An agent session is over and scored. # agent runner / any client -> trajectory manager,
    on ``sf.<run>.traj.end``."""

    session_id: Id
    reward: float = Field(description="finite (NaN and infinities are refused)")
    task_id: Id | None = None
    group_id: Id | None = None
    metrics: dict[str, float] = Field(default_factory=dict, max_length=64)
    group_size: int = Field(
        default=1, ge=1, le=1024, description="sessions in the group (attempts at the task)"
    )
    admitted: Admitted | None = Field(default=None, description="the task's, if admitted")


class SampleReady(Message):
    """One training sample (a root-to-leaf path of a session's tree).
    # trajectory manager -> trainer, on ``sf.<run>.samples``."""

    sample_id: Id = Field(description="deterministic, so re-publication is de-duplicated")
    session_id: Id
    group_id: Id
    token_ids: list[TokenId] = Field(min_length=1)
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]] = Field(
        description="1 only on model-generated tokens"
    )
    logprobs: list[float] = Field(description="behaviour logprobs; 0.0 where loss_mask is 0")
    versions: list[Annotated[int, Field(ge=-1)]] = Field(
        description="weight version per token; -1 where loss_mask is 0"
    )
    reward: float
    on_policy: bool
    task_id: Id | None = None
    group_size: int = Field(
        default=1, ge=1, le=1024, description="sessions in the group; the trainer waits for all"
    )
    session_samples: int = Field(
        default=1, ge=1, le=1 << 16, description="samples (leaf paths) the session produced"
    )
    admitted: Admitted | None = Field(default=None, description="the session's task's")

    @model_validator(mode="after")
    def _per_token_lists_align(self) -> Self:
        n = len(self.token_ids)
        sizes = (len(self.loss_mask), len(self.logprobs), len(self.versions))
        if sizes != (n, n, n):
            raise ValueError(
                f"{n} token_ids but loss_mask/logprobs/versions have {sizes}: "
                "all must have one entry per token"
            )
        return self


class WeightsPublished(Message):
    """Weights of a new policy version are ready. # trainer -> rollout workers,
    on ``sf.<run>.weights`` (last value kept)."""

    version: Version
    location: str = Field(
        min_length=1,
        max_length=4096,
        description="'objstore://<bucket>/<name>' for the embedded default, 'file://<path>', or "
        "'process://<worker id>': held by that worker's engine in the trainer's process only",
    )
    format: Literal["safetensors"] = "safetensors"
    sha256: str | None = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="checksum of the blob; None only for a host-local copy (``host`` set)",
    )
    size_bytes: int = Field(ge=0, lt=MAX_SAFE_INT)
    published_at: Timestamp
    host: str | None = Field(
        default=None,
        min_length=1,
        max_length=HEADER_MAX,
        description="set when ``location`` is a file only this host can read (the trainer's "
        "in-memory copy, ``broker.weights.host_id()``); workers elsewhere wait for the "
        "version's announcement without a host",
    )

    @model_validator(mode="after")
    def _checked_unless_local(self) -> Self:
        if self.sha256 is None and self.host is None:
            raise ValueError("sha256 is required unless the copy is host-local (host set)")
        return self


class MessageRejected(Message):
    """A payload refused at an ingress, kept with the reason. # any ingress -> operators,
    on ``sf.<run>.dead.<source>``. In JSON, ``payload`` is base64."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    source: Id = Field(description="which ingress refused it, e.g. 'tasks'")
    subject: str = Field(max_length=512)
    reason: str = Field(max_length=REASON_MAX)
    payload: bytes = Field(description="the payload as received, cut to its first 64 KiB")
    payload_size: int = Field(ge=0, lt=MAX_SAFE_INT, description="the size of the whole payload")
    content_type: str = Field(default="", max_length=HEADER_MAX)
    stream_seq: int | None = Field(default=None, ge=0, lt=MAX_SAFE_INT)
    rejected_at: Timestamp
