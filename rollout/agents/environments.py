"""The built-in envs: each one's agent and how it turns a verdict into a reward.

A configured agent (``agents.agent`` or ``agents.command``) runs any env; an env not listed
here is then scored with ``binary_reward``.
"""

from dataclasses import dataclass

from rollout.agents import arithmetic, calculator, guess
from rollout.agents.agents import Agent, chat_agent
from rollout.agents.exceptions import InvalidTaskError
from rollout.agents.rewards import Reward
from rollout.agents.verifiers import binary_reward


@dataclass(frozen=True)
class Environment:
    """An env's built-in agent and how it turns a verdict into a reward."""

    agent: Agent
    reward: Reward


ENVIRONMENTS: dict[str, Environment] = {
    "chat": Environment(chat_agent, binary_reward),
    arithmetic.ENV: Environment(arithmetic.arithmetic_agent, arithmetic.arithmetic_reward),
    guess.ENV: Environment(guess.guess_agent, guess.guess_reward),
    calculator.ENV: Environment(calculator.calculator_agent, binary_reward),
}
"""Built-in envs, by name."""


def agent_for(env: str, configured: Agent | None) -> tuple[Agent, Reward]:
    """The agent that runs a task of ``env`` (``configured``, else the env's built-in one) and
    its reward; ``InvalidTaskError`` when there is none."""
    builtin = ENVIRONMENTS.get(env)
    if configured is not None:
        return configured, builtin.reward if builtin else binary_reward
    if builtin is None:
        raise InvalidTaskError(
            f"env: no agent for env {env!r} (built-in: {', '.join(sorted(ENVIRONMENTS))}; "
            "configure agents.agent or agents.command for others)"
        )
    return builtin.agent, builtin.reward
