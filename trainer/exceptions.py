"""Errors raised by the trainer."""

from common.exceptions import SeamlessFlowError


class TrainerError(SeamlessFlowError):
    """Something in the trainer failed."""


class BackendError(TrainerError):
    """A trainer backend cannot be built or cannot run here (missing device, bad model folder)."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be written or the one on disk cannot be read."""


class BatchError(TrainerError):
    """Samples cannot form a valid batch (inconsistent group sizes, bad shapes)."""


class GroupBrokenError(TrainerError):
    """A collective of the trainer group failed (a member died, left or timed out): the step
    was abandoned with the weights and optimizer as last committed; the group re-forms."""
