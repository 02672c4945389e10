"""Errors raised by the rollout side: models, workers and the gateway."""

from seamlessflow.exceptions import SeamlessFlowError


class RolloutError(SeamlessFlowError):
    """Something in rollout failed."""


class ModelError(RolloutError):
    """A model cannot be built, found or loaded."""
