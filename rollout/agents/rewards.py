"""How an attempt gets its reward, and what happens when it cannot get one.

Three scorers, the first that applies wins:

1. the task's reward function, ``TaskSubmitted.reward.function = "module:function"``: called as
   ``function(transcript, task) -> float`` (or ``async def``) with the attempt's ``Transcript``
   (its gateway calls, the answer, and the agent's own reward if it gave one) and the task. The
   module must lie under one of ``agents.reward_modules``; else, or when it cannot be imported,
   the task is dead-lettered before any agent runs;
2. the agent's own reward: ``AgentResult.reward`` (a Python agent), or an ``SF_REWARD=<number>``
   line on a command agent's stdout;
3. the task's verifier on the answer (``reward.verifier`` with ``reward.reference``), turned
   into a reward by the env (``binary_reward``, ``arithmetic_reward``).

A reward that is not a finite number within the run's ``rewards.range`` (``common.rewards``:
the trajectory manager checks the same range), or a reward function that raises, leaves the
attempt **unscored**: it ends like a failed attempt (reward 0.0, which the range always holds,
and metrics ``unscored: 1``), so its group still completes and the task is acked; the runner
counts it in ``sf_agents_unscored_total{scorer, reason}`` and logs ``attempt_unscored`` naming
the task, the session, the scorer and the reason.
"""

import asyncio
import importlib
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from broker.messages import RewardSpec, SessionEnded, TaskSubmitted
from broker.subjects import SESSION_HEADER
from common.exceptions import UnusableRewardError
from common.rewards import checked
from rollout.agents.agents import AgentResult, openai_messages
from rollout.agents.exceptions import InvalidTaskError, UnscoredError
from rollout.agents.verifiers import bind

Reward = Callable[[bool, int], float]
"""An env's ``(correct, turns) -> reward`` for the verifier's verdict."""


@dataclass(frozen=True)
class Transcript:
    """One attempt as its reward function sees it."""

    session_id: str
    answer: str
    turns: int
    calls: tuple[dict[str, Any], ...] = ()
    """The JSON body of every ``/chat/completions`` call the agent made through ``ctx.client``,
    in order (a command agent's calls, or a client of its own, are not seen: empty)."""
    agent_reward: float | None = None
    """The reward the agent gave, if any."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The agent's own metrics."""
    prompt: tuple[dict[str, Any], ...] = ()
    """The task's messages, as the OpenAI SDK sends them."""

    @classmethod
    def of(
        cls, task: TaskSubmitted, sid: str, result: AgentResult, calls: tuple[dict[str, Any], ...]
    ) -> "Transcript":
        """The transcript of an attempt whose agent returned ``result``."""
        return cls(
            sid,
            result.answer,
            result.turns,
            calls=calls,
            agent_reward=result.reward,
            metrics=dict(result.metrics),
            prompt=tuple(openai_messages(task.messages)),
        )

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole conversation: the last call's messages (the task's when no call was seen)
        and the answer after them."""
        last = self.calls[-1].get("messages") if self.calls else None
        if not isinstance(last, list):
            last = list(self.prompt)
        return [*last, {"role": "assistant", "content": self.answer}]


RewardFunction = Callable[[Transcript, TaskSubmitted], float | Awaitable[float]]


def load_reward_function(ref: str, allowed: tuple[str, ...]) -> RewardFunction:
    """The function ``module:function``, if its module lies under one of ``allowed``;
    ``InvalidTaskError`` saying why not."""
    module_name, _, name = ref.partition(":")
    if not any(module_name == m or module_name.startswith(m + ".") for m in allowed):
        raise InvalidTaskError(
            f"reward.function: {ref!r} is not under agents.reward_modules "
            f"({', '.join(allowed) or 'none'}): add its module there to allow it"
        )
    try:
        function = getattr(importlib.import_module(module_name), name)
    except Exception as exc:  # anything its import raised: the task cannot be scored
        raise InvalidTaskError(
            f"reward.function: {ref!r} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(function):
        raise InvalidTaskError(f"reward.function: {ref!r} is not callable")
    return function


@dataclass(frozen=True)
class Scoring:
    """How one task's attempts are scored (built once per task, see ``scoring_for``)."""

    verify: Callable[[str], bool] | None
    """The verifier with its reference; None when the task has no reference."""
    env_reward: Reward
    function: RewardFunction | None
    function_ref: str | None
    reward_range: tuple[float, float]

    @property
    def records(self) -> bool:
        """Whether the attempts' gateway calls are recorded (for the reward function)."""
        return self.function is not None

    def verifier(self, task_id: str) -> Callable[[str], bool]:
        """``ctx.verify``: raises when the task has no reference to verify against."""
        if self.verify is not None:
            return self.verify

        def unverifiable(answer: str) -> bool:
            raise InvalidTaskError(f"task {task_id}: no reward.reference to verify against")

        return unverifiable

    async def score(
        self, task: TaskSubmitted, transcript: Transcript
    ) -> tuple[float, dict[str, float]]:
        """The attempt's reward and the metrics it adds; ``UnscoredError`` when it has none."""
        if self.function is not None:
            try:
                value = await _call(self.function, transcript, task)
                if inspect.isawaitable(value):
                    value = await value
            except Exception as exc:
                raise UnscoredError("raised", f"raised {type(exc).__name__}: {exc}") from exc
            return self._checked(value, "returned"), {}
        if transcript.agent_reward is not None:
            return self._checked(transcript.agent_reward, "gave"), {}
        if self.verify is None:
            raise UnscoredError("no_reward", "gave no reward and the task has no reference")
        correct = self.verify(transcript.answer)
        reward = self._checked(self.env_reward(correct, transcript.turns), "env reward")
        return reward, {"correct": 1.0 if correct else 0.0}

    def _checked(self, value: object, what: str) -> float:
        """``value`` if usable (``common.rewards.checked``), else ``UnscoredError``."""
        try:
            return checked(value, self.reward_range)
        except UnusableRewardError as exc:
            raise UnscoredError(exc.kind, f"{what} {exc.reason}") from exc

    def scorer(self, transcript: Transcript) -> str:
        """Who scored (or failed to score) an attempt, in logs and metrics:
        ``function:<module:function>``, ``agent`` or ``verifier``."""
        if self.function_ref is not None:
            return f"function:{self.function_ref}"
        return "agent" if transcript.agent_reward is not None else "verifier"


def scoring_for(
    spec: RewardSpec,
    env_reward: Reward,
    *,
    agent_may_reward: bool,
    reward_range: tuple[float, float],
    reward_modules: tuple[str, ...],
) -> Scoring:
    """A task's scoring; ``InvalidTaskError`` when nothing could ever score it (no function,
    an agent that gives no reward, and no usable verifier) or its function cannot be used."""
    function = None
    if spec.function is not None:
        function = load_reward_function(spec.function, reward_modules)
    verify = None
    if spec.reference is not None or (function is None and not agent_may_reward):
        verify = bind(spec)  # says why the reference is missing or unusable
    return Scoring(verify, env_reward, function, spec.function, reward_range)


def ended(task: TaskSubmitted, sid: str, reward: float, metrics: dict[str, float]) -> SessionEnded:
    """An attempt's ``SessionEnded`` (group id: the task's; the runner sets a retried one)."""
    return SessionEnded(
        session_id=sid,
        reward=reward,
        task_id=task.task_id,
        group_id=task.task_id,
        metrics=dict(list(metrics.items())[:64]),
        group_size=task.group_size,
        admitted=task.admitted,
    )


class CallLog:
    """Records the chat calls of the sessions opened on it, from the runner's HTTP client (an
    httpx request hook): what a reward function gets as ``Transcript.calls``."""

    def __init__(self) -> None:
        self._sessions: dict[str, list[dict[str, Any]]] = {}

    def open(self, sid: str) -> None:
        self._sessions[sid] = []

    def close(self, sid: str) -> tuple[dict[str, Any], ...]:
        return tuple(self._sessions.pop(sid, ()))

    async def on_request(self, request: httpx.Request) -> None:
        calls = self._sessions.get(request.headers.get(SESSION_HEADER, ""))
        if calls is None or not request.url.path.endswith("/chat/completions"):
            return
        try:
            body = json.loads(request.content)
        except (ValueError, httpx.RequestNotRead):
            return
        if isinstance(body, dict):
            calls.append(body)


async def _call(function: Callable[..., Any], *args: Any) -> Any:
    """Await a coroutine function; run a plain one in a thread (it may be slow)."""
    if inspect.iscoroutinefunction(function):
        return await function(*args)
    return await asyncio.to_thread(function, *args)
