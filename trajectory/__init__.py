"""Trajectory manager: turns call records into per-session token prefix trees, and finished
sessions into labelled training samples (loss mask, behaviour logprobs, version per token).

``trajectory.tree`` is the pure core (the model is in its docstring); ``trajectory.manager`` wires
it to the broker (``TrajectoryManager``, ``serve_trajectory``, metrics ``sf_trajectory_*``).
Talks to the other parts only through ``broker``.
"""

from trajectory.config import TrajectoryConfig
from trajectory.tree import ENV, Leaf, SessionBuild, SessionTree, build_session, sample_id

__all__ = [
    "ENV",
    "Leaf",
    "SessionBuild",
    "SessionTree",
    "TrajectoryConfig",
    "build_session",
    "sample_id",
]
