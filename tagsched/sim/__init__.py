"""A discrete-event simulator of a SeamlessFlow cluster on the scheduler's own policy code.

``simulate`` runs one arm; ``best_split`` sweeps the trainer/rollout split of the static
layout. The model and its assumptions: ``tagsched.sim.cluster`` and ``tagsched.sim.engine``.
"""

from tagsched.sim.cluster import ARMS, Arm, Cluster, SimResult, StaleMode
from tagsched.sim.run import best_split, simulate, split_candidates

__all__ = [
    "ARMS",
    "Arm",
    "Cluster",
    "SimResult",
    "StaleMode",
    "best_split",
    "simulate",
    "split_candidates",
]
