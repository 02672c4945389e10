"""Errors raised by the agent runner."""

from broker.exceptions import UnavailableError
from broker.ingress import HandBack
from rollout.exceptions import RolloutError


class AgentsError(RolloutError):
    """Something in the agent runner failed."""


class InvalidTaskError(AgentsError):
    """A task cannot be run as given (unknown verifier, unusable reference, no agent for its
    env); it is dead-lettered."""


class AgentLoadError(AgentsError):
    """A configured ``module:function`` agent cannot be imported or is not an async function."""


class AgentFailedError(AgentsError):
    """An attempt's agent failed (raised, exited non-zero, or timed out)."""


class GatewayUnavailableError(AgentsError, UnavailableError):
    """The gateway cannot serve calls now: the task is held and run again once it serves (the
    ingress pauses meanwhile), never scored against the outage nor dead-lettered for it."""


class RunnerStoppingError(AgentsError, HandBack):
    """The runner is stopping: the task's attempts were cancelled and the task handed back."""


class UnscoredError(AgentsError):
    """An attempt's reward is unusable (not a finite number in range) or its reward function
    raised: the attempt ends unscored, with reward 0.0 and the reason counted and logged."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        """A short label for metrics: raised, not_a_number, not_finite, out_of_range,
        no_reward."""
        self.reason = reason
