"""A multi-agent built-in: a solver and a checker share the policy within one session.

Reference it as ``agents.agent = "rollout.agents.multi_agent:solver_checker"`` (any task with a
verifier and a reference; written for the ``arithmetic`` tasks). Per attempt, both roles call
the gateway through ``ctx.client``, so under the attempt's one session id, each with its own
prompt and its own history:

1. the **solver** is an existing single agent, unchanged: it gets the task's messages as they
   are (for ``arithmetic``, the one user message ``a+b=`` the warm start taught) and answers;
2. the **checker** (system ``CHECKER_SYSTEM``), in a conversation of its own, is shown the
   question and the solver's answer and works the question out again; it *accepts* the answer
   when the last number of its reply equals the last number of the solver's;
3. accepted, or no turns left (``task.max_turns`` solver turns): the solver's answer is the
   attempt's answer. Rejected: the solver is told ``FEEDBACK`` ("wrong") in its own history and
   answers again, and a fresh checker conversation checks the new answer.

The answer is scored as any other (the task's verifier and the env's reward, e.g. 1.0 right on
the first solver turn, 0.5 later): one **shared reward** for both roles. The checker is trained
by it too: rejecting a right answer costs a turn (0.5 instead of 1.0), accepting a wrong one
ends the attempt at 0.0.

The session's token tree has one branch per conversation: the solver's (extended turn by turn,
or forked where a re-sent answer re-tokenizes differently) and one per checker call (the
checker's conversation opens with its own system prompt, the solver's with the task's
messages, so the two part within the first tokens). Each leaf is its own sample with the
session's reward; the solver's answer reaches the checker as prompt text, so it is never in the
checker's loss mask.
"""

import re
from typing import Any

from rollout.agents.agents import (
    AgentContext,
    AgentResult,
    complete,
    max_tokens_of,
    openai_messages,
)

CHECKER_SYSTEM = "Checker: work the question out again, then give the result."
CHECK_PROMPT = "Question: {question}\nProposed answer: {answer}\nCheck: {question}"
"""The checker's user message; ``question`` is the task's last user message."""
FEEDBACK = "wrong"
"""What the solver is told when the checker rejects its answer."""
MAX_TOKENS = 8
"""Tokens per reply unless the task's ``metadata["max_tokens"]`` says otherwise."""

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def agrees(check: str, answer: str) -> bool:
    """The checker's reply accepts ``answer``: both end in the same number."""
    mine = last_number(check)
    return mine is not None and mine == last_number(answer)


def checker_messages(question: str, answer: str) -> list[dict[str, Any]]:
    """The checker's whole conversation: its system prompt and the question with the answer."""
    return [
        {"role": "system", "content": CHECKER_SYSTEM},
        {"role": "user", "content": CHECK_PROMPT.format(question=question, answer=answer)},
    ]


async def _reply(ctx: AgentContext, messages: list[dict[str, Any]]) -> str:
    message = await complete(ctx, messages, max_tokens_of(ctx.task, MAX_TOKENS))
    return message.content or ""


async def solver_checker(ctx: AgentContext) -> AgentResult:
    """Solve, have the answer checked, and solve again while rejected and turns remain."""
    task_messages = openai_messages(ctx.task.messages)
    question = next(
        (m.get("content") or "" for m in reversed(task_messages) if m["role"] == "user"), ""
    )
    solver = list(task_messages)
    turn = 0
    while True:
        turn += 1
        answer = await _reply(ctx, solver)
        check = await _reply(ctx, checker_messages(question, answer))
        accepted = agrees(check, answer)
        if accepted or turn >= ctx.task.max_turns:
            metrics = {"calls": 2.0 * turn, "checker_accepted": float(accepted)}
            if ctx.task.reward.reference is not None:  # how often the checker was right
                metrics["checker_right"] = float(accepted == ctx.verify(answer))
            return AgentResult(answer=answer, turns=turn, metrics=metrics)
        solver += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": FEEDBACK},
        ]
