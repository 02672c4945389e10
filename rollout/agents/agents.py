"""The agent kinds the runner runs, one attempt at a time.

An agent is ``async def agent(ctx: AgentContext) -> AgentResult``: it talks to the model only
through the gateway (``ctx.client``, which names the attempt's session on every call) and
returns its final answer, which the runner then verifies. Two kinds:

- a Python coroutine function, named in config as ``module:function`` (``load_agent``), or one
  of the built-in agents of an env (``chat_agent`` here, ``rollout.agents.arithmetic``);
- an external command in any language (``CommandAgent``), run once per attempt: env
  ``SF_GATEWAY_URL`` (base URL with ``/v1``), ``SF_GATEWAY_KEY`` (its bearer key, the SDKs'
  ``api_key``), ``SF_SESSION_ID``, ``SF_MODEL``, and the runner's
  sampling settings ``SF_TEMPERATURE`` and ``SF_MAX_TOKENS``; the task as JSON
  on stdin; the last line of stdout is the answer, except lines ``SF_REWARD=<number>``: the last
  of those is the attempt's own reward (``AgentResult.reward``). Exit 0: done; exit 75
  (``EX_TEMPFAIL``): the gateway failed, retry the task later; any other code: the attempt
  failed.

How the reward is then chosen (the task's reward function, the agent's reward, the verifier)
and checked: ``rollout.agents.rewards``.

What the built-in envs share is here too: ``complete`` (one model call) and ``converse`` (the
turn loop) for their agents, ``env_task`` and ``env_tasks`` for their tasks.
"""

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessage

from broker import codec
from broker.messages import ChatMessage, RewardSpec, TaskSubmitted
from rollout.agents.exceptions import (
    AgentFailedError,
    AgentLoadError,
    GatewayUnavailableError,
    UnscoredError,
)
from rollout.agents.sessions import gateway_headers

EX_TEMPFAIL = 75
"""An external command exits with this when the gateway failed: the task is retried."""
_STDERR_KEEP = 1000
REWARD_LINE = "SF_REWARD="
"""A command agent's stdout line ``SF_REWARD=<number>`` gives the attempt's reward."""


@dataclass(frozen=True)
class AgentContext:
    """What an agent gets for one attempt at a task."""

    task: TaskSubmitted
    session_id: str
    gateway_url: str
    """The gateway's OpenAI base URL, ending in ``/v1``."""
    client: openai.AsyncOpenAI
    """Ready to call: sends ``headers`` with every request."""
    model: str
    temperature: float
    max_tokens: int
    verify: Callable[[str], bool]
    """The task's verifier with its reference: environment feedback for multi-turn agents."""
    api_key: str = "unused"
    """The gateway key ``client`` calls with (``"unused"`` for a gateway without keys): the
    ``api_key`` of a client of one's own."""

    @property
    def headers(self) -> dict[str, str]:
        """What ``client`` sends with every call (for a client of one's own)."""
        return gateway_headers(self.session_id, self.task.task_id)


@dataclass(frozen=True)
class AgentResult:
    """An attempt's outcome as its agent reports it; the runner scores it (``rewards``)."""

    answer: str
    turns: int = 1
    metrics: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    """The agent's (or its environment's) own reward; None: the task's verifier scores."""


Agent = Callable[[AgentContext], Awaitable[AgentResult]]
Answer = Callable[[ChatCompletionMessage], Awaitable[list[dict[str, Any]]]]
"""An env's answer to a reply that does not end the attempt (``converse``): the messages to add."""


def load_agent(ref: str) -> Agent:
    """The coroutine function named ``module:function``."""
    module_name, _, name = ref.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise AgentLoadError(
            f"agent {ref!r} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not inspect.iscoroutinefunction(function):
        raise AgentLoadError(f"agent {ref!r} must be an `async def` function taking AgentContext")
    return function


def openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A task's messages as the OpenAI SDK sends them (no nulls, no empty tool_calls)."""
    out = []
    for message in messages:
        item = message.model_dump(exclude_none=True)
        if not item["tool_calls"]:
            del item["tool_calls"]
        out.append(item)
    return out


def max_tokens_of(task: TaskSubmitted, default: int) -> int:
    """Tokens per model call: the task's ``metadata["max_tokens"]``, else ``default``."""
    return int(task.metadata.get("max_tokens", default))


async def complete(
    ctx: AgentContext, messages: list[dict[str, Any]], max_tokens: int, **options: Any
) -> ChatCompletionMessage:
    """One model call of the attempt, at its model and temperature (``options``: more request
    fields, e.g. ``tools``); the reply's message."""
    reply = await ctx.client.chat.completions.create(
        model=ctx.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=ctx.temperature,
        **options,
    )
    return reply.choices[0].message


async def converse(
    ctx: AgentContext,
    answer: Answer,
    max_tokens: int,
    *,
    done: Callable[[ChatCompletionMessage], bool] | None = None,
    **options: Any,
) -> tuple[ChatCompletionMessage, int]:
    """The model's last reply and the turns taken: ask with the task's messages; until a reply
    is ``done`` (default: ``ctx.verify`` accepts its text) or no turns remain, add the env's
    ``answer`` to it and ask again. Each call asks for ``max_tokens_of(task, max_tokens)``
    tokens."""
    done = done or (lambda message: ctx.verify(message.content or ""))
    messages = openai_messages(ctx.task.messages)
    tokens = max_tokens_of(ctx.task, max_tokens)
    turn = 0
    while True:
        turn += 1
        message = await complete(ctx, messages, tokens, **options)
        if done(message) or turn >= ctx.task.max_turns:
            return message, turn
        messages += await answer(message)


def env_task(
    task_id: str,
    env: str,
    question: str,
    reward: RewardSpec,
    *,
    group_size: int,
    max_turns: int,
    max_tokens: int,
    metadata: dict[str, str],
) -> TaskSubmitted:
    """A task of a built-in env: ``question`` as the one user message, ``max_tokens`` per turn
    (``metadata["max_tokens"]``) after the env's own ``metadata``."""
    return TaskSubmitted(
        task_id=task_id,
        messages=[ChatMessage(role="user", content=question)],
        env=env,
        reward=reward,
        group_size=group_size,
        max_turns=max_turns,
        metadata={**metadata, "max_tokens": str(max_tokens)},
    )


def env_tasks(n: int, prefix: str, task: Callable[[str], TaskSubmitted]) -> list[TaskSubmitted]:
    """``n`` tasks ``task("<prefix>-<i>")``, in order."""
    return [task(f"{prefix}-{i}") for i in range(n)]


async def chat_agent(ctx: AgentContext) -> AgentResult:
    """The built-in agent of env ``chat``: one call with the task's messages; the reply is the
    answer."""
    message = await complete(ctx, openai_messages(ctx.task.messages), ctx.max_tokens)
    return AgentResult(answer=message.content or "")


class CommandAgent:
    """An external command run once per attempt (see the module docstring for its contract).
    Cancelling the attempt (timeout, shutdown) kills the command's whole process group."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    async def __call__(self, ctx: AgentContext) -> AgentResult:
        env = {
            **os.environ,
            "SF_GATEWAY_URL": ctx.gateway_url,
            "SF_GATEWAY_KEY": ctx.api_key,
            "SF_SESSION_ID": ctx.session_id,
            "SF_MODEL": ctx.model,
            "SF_TEMPERATURE": repr(ctx.temperature),
            "SF_MAX_TOKENS": str(ctx.max_tokens),
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,  # its own process group, killed as one
            )
        except OSError as exc:
            raise AgentFailedError(f"cannot start {self.argv[0]!r}: {exc}") from exc
        try:
            out, err = await proc.communicate(codec.encode(ctx.task, codec.Encoding.JSON))
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        stderr = err.decode(errors="replace")[-_STDERR_KEEP:].strip()
        if proc.returncode == EX_TEMPFAIL:
            raise GatewayUnavailableError(f"{self.argv[0]} exited {EX_TEMPFAIL}: {stderr}")
        if proc.returncode != 0:
            raise AgentFailedError(f"{self.argv[0]} exited {proc.returncode}: {stderr}")
        return command_result(out.decode(errors="replace"))


def command_result(stdout: str) -> AgentResult:
    """A command's answer (its last line) and reward (its last ``SF_REWARD=`` line, if any);
    ``UnscoredError`` when that reward is not a number."""
    # Lines end at "\n" only: other control characters may be part of the answer.
    lines = [line.removesuffix("\r") for line in stdout.removesuffix("\n").split("\n")]
    rewards = [line for line in lines if line.startswith(REWARD_LINE)]
    answers = [line for line in lines if not line.startswith(REWARD_LINE)]
    reward = None
    if rewards:
        text = rewards[-1].removeprefix(REWARD_LINE).strip()
        try:
            reward = float(text)
        except ValueError:
            raise UnscoredError("not_a_number", f"printed {rewards[-1][:80]!r}") from None
    return AgentResult(answer=answers[-1] if answers else "", reward=reward)
