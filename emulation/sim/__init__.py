"""A discrete-event simulator of a SeamlessFlow cluster on the scheduler's own policy code.

``simulate`` runs one arm; ``best_split`` sweeps the trainer/rollout split of the static
layout. The model and its assumptions: ``emulation.sim.cluster`` (the event loop),
``emulation.sim.placement`` (who does what per arm), ``emulation.sim.lending`` (the scheduler's
lending), ``emulation.sim.engine`` and ``emulation.sim.order`` (which groups the trainer steps
on, and when), ``emulation.sim.rhythm`` (verl's, to compare with its published gains); what a
run measures: ``emulation.sim.measure``.
"""

from emulation.sim.cluster import Cluster
from emulation.sim.measure import SimResult
from emulation.sim.order import Order, TrainerOrder
from emulation.sim.placement import ARMS, Arm
from emulation.sim.rhythm import Rhythm
from emulation.sim.run import best_split, simulate, split_candidates

__all__ = [
    "ARMS",
    "Arm",
    "Cluster",
    "Order",
    "Rhythm",
    "SimResult",
    "TrainerOrder",
    "best_split",
    "simulate",
    "split_candidates",
]
