"""The long-horizon environment ``guess``: find a secret number with "higher"/"lower" feedback.

A task asks ``f"Guess my number, from 1 to {high}."`` in one user message; the secret is drawn
in ``[1, high]`` and is the task's reference (verifier ``number``: the first number of a
reply is the guess). The built-in agent asks the model for a guess each turn; the environment
answers ``"higher"`` or ``"lower"`` (or ``"a number"`` to a reply without one), after its own
latency (``metadata["turn_delay_s"]``, slept every turn, like a real environment's step), until
the guess is right or ``max_turns`` turns are spent. Every turn appends to one conversation, so
the session is one growing prompt: one sample, every guess in its loss mask.

Reward (``guess_reward``): 1.0 for the secret on the first turn, 0.1 less per further turn (at
least ``MIN_FOUND``), 0.0 when not found within the turn cap; so a policy that uses the feedback
(halving the range) earns more than one that finds the number late or not at all.

Demonstrations for the warm start (``demonstration``) guess uniformly within the range the
feedback so far leaves open: they teach the format and the use of the feedback, not the
halving, so RL has turns to save.
"""

import asyncio
import random

from broker.messages import ChatMessage, RewardSpec, TaskSubmitted
from rollout.agents.agents import AgentContext, AgentResult, openai_messages
from rollout.agents.verifiers import first_number

ENV = "guess"
PROMPT = "Guess my number, from 1 to {high}."
"""The first (user) message, formatted with ``high``."""
HIGHER = "higher"
"""The secret is above the guess."""
LOWER = "lower"
"""The secret is below the guess."""
NO_GUESS = "a number"
"""The reply held no number."""
VERIFIER = "number"
MAX_TOKENS = 4
"""Tokens per guess (a number), unless ``metadata["max_tokens"]`` says otherwise."""
STEP = 0.1
"""Reward lost per turn after the first."""
MIN_FOUND = 0.1
"""The least reward for finding the secret, however late."""


def question(high: int) -> str:
    return PROMPT.format(high=high)


def feedback(guess: int | None, secret: int) -> str:
    """What the environment says to a wrong guess (``None``: the reply held no number)."""
    if guess is None:
        return NO_GUESS
    return HIGHER if secret > guess else LOWER


def guess_reward(correct: bool, turns: int) -> float:
    """1.0 found on the first turn, ``STEP`` less per later turn (at least ``MIN_FOUND``); 0.0
    not found."""
    if not correct:
        return 0.0
    return max(MIN_FOUND, round(1.0 - STEP * (turns - 1), 6))


def guess_task(
    task_id: str,
    secret: int,
    *,
    high: int,
    group_size: int,
    max_turns: int,
    turn_delay_s: float = 0.0,
    max_tokens: int = MAX_TOKENS,
) -> TaskSubmitted:
    """Find ``secret`` in ``[1, high]`` within ``max_turns`` guesses."""
    if not 1 <= secret <= high:
        raise ValueError(f"secret {secret} is not in [1, {high}]")
    return TaskSubmitted(
        task_id=task_id,
        messages=[ChatMessage(role="user", content=question(high))],
        env=ENV,
        reward=RewardSpec(verifier=VERIFIER, reference=str(secret)),
        group_size=group_size,
        max_turns=max_turns,
        metadata={
            "high": str(high),
            "turn_delay_s": f"{turn_delay_s:g}",
            "max_tokens": str(max_tokens),
        },
    )


def guess_tasks(
    rng: random.Random,
    n: int,
    *,
    high: int,
    group_size: int,
    max_turns: int,
    prefix: str,
    turn_delay_s: float = 0.0,
    max_tokens: int = MAX_TOKENS,
) -> list[TaskSubmitted]:
    """``n`` tasks ``<prefix>-<i>``, secrets drawn from ``[1, high]``."""
    return [
        guess_task(
            f"{prefix}-{i}",
            rng.randint(1, high),
            high=high,
            group_size=group_size,
            max_turns=max_turns,
            turn_delay_s=turn_delay_s,
            max_tokens=max_tokens,
        )
        for i in range(n)
    ]


def demonstration(rng: random.Random, high: int) -> tuple[list[dict[str, str]], str]:
    """A game in progress and its next guess, drawn uniformly from the range still open: the
    messages so far (a random number of wrong guesses, each with its feedback) and the reply."""
    secret = rng.randint(1, high)
    messages = [{"role": "user", "content": question(high)}]
    low, top = 1, high
    for _ in range(rng.randint(0, 7)):
        guess = rng.randint(low, top)
        if guess == secret:
            break
        if secret > guess:
            low = guess + 1
        else:
            top = guess - 1
        messages += [
            {"role": "assistant", "content": str(guess)},
            {"role": "user", "content": feedback(guess, secret)},
        ]
    return messages, str(rng.randint(low, top))


async def guess_agent(ctx: AgentContext) -> AgentResult:
    """Ask for a guess; while wrong and turns remain, the environment (after its latency) says
    higher or lower and the model guesses again."""
    messages = openai_messages(ctx.task.messages)
    secret = int(ctx.task.reward.reference or "0")
    delay = float(ctx.task.metadata.get("turn_delay_s", "0"))
    max_tokens = int(ctx.task.metadata.get("max_tokens", MAX_TOKENS))
    turn = 0
    while True:
        turn += 1
        reply = await ctx.client.chat.completions.create(
            model=ctx.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=ctx.temperature,
        )
        text = reply.choices[0].message.content or ""
        if ctx.verify(text) or turn >= ctx.task.max_turns:
            return AgentResult(answer=text, turns=turn)
        guess = first_number(text)
        await asyncio.sleep(delay)  # the environment's step
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": feedback(None if guess is None else int(guess), secret)},
        ]
