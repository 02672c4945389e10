"""Errors raised by the tag scheduler."""

from common.exceptions import SeamlessFlowError


class TagschedError(SeamlessFlowError):
    """Something in the tag scheduler failed."""


class AdmissionError(TagschedError):
    """Admission settings that cannot keep the staleness bound."""


class UnsatisfiableSpecError(TagschedError):
    """The live workers cannot meet a placement spec; the message names the missing tags."""


class LeaseLostError(TagschedError):
    """Another scheduler holds the run's lease now."""


class SchedulerError(TagschedError):
    """The scheduler cannot go on (an unsatisfiable spec past its timeout)."""
