"""Errors raised by the trajectory manager."""

from seamlessflow.exceptions import SeamlessFlowError


class TrajectoryError(SeamlessFlowError):
    """The trajectory manager cannot run (e.g. its run is not provisioned)."""
