"""The quickstart environment ``arithmetic``: add two integers, with feedback.

A task asks ``f"{a}+{b}="`` in one user message; the reference is ``str(a + b)``, checked by the
``last_number`` verifier. The built-in agent asks the model; while the answer is wrong and turns
remain, it echoes the reply and says ``"wrong"`` and asks again. Reward: 1.0 when right on the
first turn, 0.5 when right on a later one, else 0.0.

The prompt, answer and feedback strings are module constants so that other code (warm-start
data) writes exactly what the environment asks.
"""

import random
from typing import Any

from openai.types.chat import ChatCompletionMessage

from broker.messages import RewardSpec, TaskSubmitted
from rollout.agents.agents import AgentContext, AgentResult, converse, env_task, env_tasks

ENV = "arithmetic"
PROMPT = "{a}+{b}="
"""The first (user) message, formatted with ``a`` and ``b``."""
ANSWER = "{total}"
"""The reference answer, formatted with ``total = a + b``."""
FEEDBACK = "wrong"
"""The user message after a wrong answer."""
VERIFIER = "last_number"
"""A worked answer (``3+4=7``) restates the operands; its result is the last number."""
MAX_TOKENS = 8
"""Tokens the agent asks for per turn, unless the task's ``metadata["max_tokens"]`` says
otherwise: enough for a number (a model that answers in sentences needs more)."""


def question(a: int, b: int) -> str:
    return PROMPT.format(a=a, b=b)


def answer(a: int, b: int) -> str:
    return ANSWER.format(total=a + b)


def arithmetic_task(
    task_id: str,
    a: int,
    b: int,
    *,
    group_size: int,
    max_turns: int,
    max_tokens: int = MAX_TOKENS,
) -> TaskSubmitted:
    """The task ``a + b``; answers of up to ``max_tokens`` tokens per turn."""
    return env_task(
        task_id,
        ENV,
        question(a, b),
        RewardSpec(verifier=VERIFIER, reference=answer(a, b)),
        group_size=group_size,
        max_turns=max_turns,
        max_tokens=max_tokens,
        metadata={"a": str(a), "b": str(b)},
    )


def arithmetic_tasks(
    rng: random.Random,
    n: int,
    *,
    max_operand: int,
    group_size: int,
    max_turns: int,
    prefix: str,
    max_tokens: int = MAX_TOKENS,
) -> list[TaskSubmitted]:
    """``n`` tasks ``<prefix>-<i>`` with operands drawn from ``[0, max_operand]``."""
    return env_tasks(
        n,
        prefix,
        lambda task_id: arithmetic_task(
            task_id,
            rng.randint(0, max_operand),
            rng.randint(0, max_operand),
            group_size=group_size,
            max_turns=max_turns,
            max_tokens=max_tokens,
        ),
    )


def arithmetic_reward(correct: bool, turns: int) -> float:
    """1.0 right on the first turn, 0.5 right later, 0.0 wrong."""
    if not correct:
        return 0.0
    return 1.0 if turns == 1 else 0.5


async def arithmetic_agent(ctx: AgentContext) -> AgentResult:
    """Ask; while wrong and turns remain, echo the reply, say ``FEEDBACK`` and ask again."""

    async def feedback(message: ChatCompletionMessage) -> list[dict[str, Any]]:
        return [
            {"role": "assistant", "content": message.content or ""},
            {"role": "user", "content": FEEDBACK},
        ]

    message, turns = await converse(ctx, feedback, MAX_TOKENS)
    return AgentResult(answer=message.content or "", turns=turns)
