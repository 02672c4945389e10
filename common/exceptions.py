"""The root of every error SeamlessFlow raises on purpose."""


class SeamlessFlowError(Exception):
    """Base class of all SeamlessFlow errors; each package derives its own from it."""


class ModelError(SeamlessFlowError):
    """A model cannot be built, found or loaded."""


class UnusableRewardError(SeamlessFlowError):
    """A reward that is not a finite number within the run's ``rewards.range``."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        """A short label for metrics: not_a_number, not_finite, out_of_range."""
        self.reason = reason
