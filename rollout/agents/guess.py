"""The long-horizon environment ``guess``: find a secret number with "higher"/"lower" feedback.

A task asks ``f"Guess my number, from 1 to {high}."`` in one user message; the secret is drawn
in ``[1, high]`` and is the task's reference (verifier ``number``: the first number of a
reply is the guess). The built-in agent asks the model for a guess each turn; the environment
answers ``"higher"`` or ``"lower"`` (``"a number"`` to a reply without one) with the range the
answers so far leave open (``"higher: 9-16"``), after its own latency
(``metadata["turn_delay_s"]``, slept every turn, like a real environment's step), until the
guess is right or ``max_turns`` turns are spent. (The range is restated because the tiny model
did not learn, in minutes of RL, to work it out from bare "higher"/"lower" over the history:
its reward stayed flat or fell over 16-32 steps.) Every turn appends to one conversation, so
the session is one growing prompt: one sample, every guess in its loss mask.

Reward (``episode_reward``, the agent's own, computed from the game it played): half for
finding the secret and how fast (``guess_reward``: 1.0 on the first turn, 0.1 less per further
turn, at least ``MIN_FOUND``; 0.0 not found within the turn cap), half for the fraction of its
guesses that fell inside the range the feedback had left open when they were made (a reply
without a number is outside). One float per episode in [0, 1]. The second half is shaping for a
tiny model: found-or-not alone was too sparse for RL to improve in minutes of CPU
(docs/agents.md, section 7), while a game not won still shows, guess by guess, whether the
feedback was used. The metrics ``found`` and ``in_range`` (and the runner's ``turns``) report
the two halves apart. A configured agent playing ``guess`` (one that gives no reward) is scored
by the verifier with ``guess_reward`` alone: it is not known which of its guesses were in range.

Demonstrations for the warm start (``demonstration``) guess uniformly within the open range:
they teach the format and the use of the feedback, not the halving, so RL has turns to save.
"""

import asyncio
import random
from dataclasses import dataclass, replace
from typing import Any

from openai.types.chat import ChatCompletionMessage

from broker.messages import RewardSpec, TaskSubmitted
from rollout.agents.agents import AgentContext, AgentResult, converse, env_task, env_tasks
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
FEEDBACK = "{verdict}: {low}-{high}"
"""The user message after a wrong guess: the verdict and the range still open."""
VERIFIER = "number"
MAX_TOKENS = 4
"""Tokens per guess (a number), unless ``metadata["max_tokens"]`` says otherwise."""
IN_RANGE_WEIGHT = 0.5
"""The share of ``episode_reward`` given for guessing within the open range."""
STEP = 0.1
"""Reward lost per turn after the first."""
MIN_FOUND = 0.1
"""The least reward for finding the secret, however late."""


def question(high: int) -> str:
    return PROMPT.format(high=high)


@dataclass(frozen=True)
class Game:
    """What the environment knows: the secret and the range its answers have left open."""

    secret: int
    low: int
    high: int

    def open(self, guess: int | None) -> bool:
        """Whether ``guess`` lies in the range still open (``None``: no number, it does not)."""
        return guess is not None and self.low <= guess <= self.high

    def answer(self, guess: int | None) -> tuple["Game", str]:
        """The game after a wrong ``guess`` (``None``: the reply held no number), and what the
        environment says to it."""
        if guess is None:
            verdict, game = NO_GUESS, self
        elif self.secret > guess:
            verdict, game = HIGHER, replace(self, low=max(self.low, guess + 1))
        else:
            verdict, game = LOWER, replace(self, high=min(self.high, guess - 1))
        return game, FEEDBACK.format(verdict=verdict, low=game.low, high=game.high)


def guess_reward(correct: bool, turns: int) -> float:
    """1.0 found on the first turn, ``STEP`` less per later turn (at least ``MIN_FOUND``); 0.0
    not found."""
    if not correct:
        return 0.0
    return max(MIN_FOUND, round(1.0 - STEP * (turns - 1), 6))


def episode_reward(found: bool, turns: int, in_range: int) -> float:
    """The reward of a game of ``turns`` guesses, ``in_range`` of them inside the range open when
    made: ``(1 - IN_RANGE_WEIGHT) * guess_reward(found, turns) + IN_RANGE_WEIGHT * in_range /
    turns``, in [0, 1]."""
    if not 0 <= in_range <= turns:
        raise ValueError(f"{in_range} guesses in range out of {turns}")
    shaped = IN_RANGE_WEIGHT * in_range / turns
    return round((1.0 - IN_RANGE_WEIGHT) * guess_reward(found, turns) + shaped, 6)


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
    return env_task(
        task_id,
        ENV,
        question(high),
        RewardSpec(verifier=VERIFIER, reference=str(secret)),
        group_size=group_size,
        max_turns=max_turns,
        max_tokens=max_tokens,
        metadata={"high": str(high), "turn_delay_s": f"{turn_delay_s:g}"},
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
    return env_tasks(
        n,
        prefix,
        lambda task_id: guess_task(
            task_id,
            rng.randint(1, high),
            high=high,
            group_size=group_size,
            max_turns=max_turns,
            turn_delay_s=turn_delay_s,
            max_tokens=max_tokens,
        ),
    )


def demonstration(rng: random.Random, high: int) -> tuple[list[dict[str, str]], str]:
    """A game in progress and its next guess, drawn uniformly from the range still open: the
    messages so far (a random number of wrong guesses, each with its feedback) and the reply."""
    game = Game(rng.randint(1, high), 1, high)
    messages = [{"role": "user", "content": question(high)}]
    for _ in range(rng.randint(0, 7)):
        guess = rng.randint(game.low, game.high)
        if guess == game.secret:
            break
        game, said = game.answer(guess)
        messages += [
            {"role": "assistant", "content": str(guess)},
            {"role": "user", "content": said},
        ]
    return messages, str(rng.randint(game.low, game.high))


def parse_guess(reply: str) -> int | None:
    """A reply's guess: its first number (``None``: it has none)."""
    number = first_number(reply)
    return None if number is None else int(number)


async def guess_agent(ctx: AgentContext) -> AgentResult:
    """Ask for a guess; while wrong and turns remain, the environment (after its latency) says
    higher or lower and the model guesses again. The reward is ``episode_reward`` of the game."""
    game = Game(int(ctx.task.reward.reference or "0"), 1, int(ctx.task.metadata.get("high", "0")))
    delay = float(ctx.task.metadata.get("turn_delay_s", "0"))
    in_range = 0

    async def feedback(message: ChatCompletionMessage) -> list[dict[str, Any]]:
        nonlocal game, in_range
        guess = parse_guess(message.content or "")
        in_range += game.open(guess)
        await asyncio.sleep(delay)  # the environment's step
        game, said = game.answer(guess)
        return [
            {"role": "assistant", "content": message.content or ""},
            {"role": "user", "content": said},
        ]

    message, turns = await converse(ctx, feedback, MAX_TOKENS)
    in_range += game.open(parse_guess(message.content or ""))  # the last one: no feedback
    found = ctx.verify(message.content or "")
    return AgentResult(
        answer=message.content or "",
        turns=turns,
        metrics={"found": float(found), "in_range": in_range / turns},
        reward=episode_reward(found, turns, in_range),
    )
