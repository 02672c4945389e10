"""The root of every error SeamlessFlow raises on purpose."""


class SeamlessFlowError(Exception):
    """Base class of all SeamlessFlow errors; each package derives its own from it."""


class ModelError(SeamlessFlowError):
    """A model cannot be built, found or loaded."""
