"""A short run's measured costs as the simulator's workload: ``fit`` reads a run's
``summary.json`` (the trainer's and scheduler's numbers and ``costs``, see
``seamlessflow.costs.run_costs``) into a ``Workload`` and the run's own shape, for
``seamlessflow plan`` (``emulation.plan``):

- **engine** (``EngineCost.a_s``, ``b_s``): per level of calls in flight per serving engine
  (``batch``), the run's engines made ``tokens`` in ``seconds`` (the trainer's steps and the
  weight loads left out where they stop engines: ``seamlessflow.costs.engine_load``); a
  decode iteration of ``batch`` residents took ``batch * seconds / tokens``. A line
  through those points, weighted by tokens (prefill and queueing folded in: the cost as the
  calls saw it);
- **trainer** (``TrainerCost``): the per-token part from the phases that scale with tokens
  (proximal, reference, forward, backward) over the loss tokens, the fixed part the rest of a
  step plus what the step's path adds (the in-step weight publish, the checkpoint stall);
- **weight sync**: optimizer step -> every worker serving, less the publish and stall already
  in the trainer's step;
- **switch**: the scheduler's mean lend and reclaim seconds. A run without lends has none: the
  engines' pause before and resume after a weight load stand in (a lend's and a reclaim's
  engine part, from the summary's ``rollout``), else the scheduler's own assumption,
  ``SchedulerConfig.switch_cost_s``; either says so;
- **shape and lengths**: group size, groups per step, turns (calls per sample, rounded; the
  median tokens per call scaled so that a sample has the tokens its calls had), tokens per call
  (lognormal: median and log sd, capped at the answer's ``max tokens``), the mean gap between a
  session's calls as the environment's latency, the mean time from a task's admission to its
  sessions' first calls as the agent's start latency (0 from a run without it).
- **the trainer's order** (``TrainerOrder``): its staleness mode, admission or overlap order and
  wait bound, as the run's trainer had them (its defaults from a summary without them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from common.exceptions import SeamlessFlowError
from emulation.sim import Arm, TrainerOrder
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    SwitchCost,
    TrainerCost,
    Workload,
)
from tagsched.config import SchedulerConfig
from trainer.config import TrainerConfig

LINEAR_PHASES = ("proximal", "reference", "forward", "backward")
"""The trainer phases whose time grows with the tokens trained (``trainer.step.PHASES``)."""
LAYOUT_OF = {
    Arm.COLOCATED: "colocated",
    Arm.PARTIAL_ROLLOUT: "disaggregated",
    Arm.MULTIPLEXED: "multiplexed",
}
"""The ``[layout] kind`` that runs each arm. The simulator's ``disaggregated`` arm (in-flight
work drained on the old weights before a load) has none: seamlessflow's workers always continue
on the new weights; nor has ``sync_colocated`` (synchronous, the baseline)."""
ARM_OF = {layout: arm for arm, layout in LAYOUT_OF.items()}
ORDER_KEYS = {
    "staleness mode": "staleness_mode",
    "overlap": "overlap",
    "order wait seconds": "order_wait_s",
}
"""The trainer's order in a summary's ``costs`` (``seamlessflow.costs``): its config fields."""


class PlanError(SeamlessFlowError):
    """A summary the planner cannot fit: unreadable, or without a cost it needs."""


@dataclass(frozen=True)
class Fit:
    """A run's measured costs as the simulator's workload, and the run's own shape."""

    workload: Workload
    arm: Arm
    devices: int
    trainer_devices: int
    staleness: int
    order: TrainerOrder
    """How the run's trainer chose a step's groups (the simulator's default is another)."""
    measured_s_per_step: float
    """After the first quarter of the run's steps if it says (``step seconds (steady)``), else
    over the whole run."""
    assumed: tuple[str, ...]
    """The costs the run did not measure, and what stands in for them."""


def load_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path} is not JSON ({exc}); give a run's summary.json") from exc
    if not isinstance(summary, dict):
        raise PlanError(f"{path} is not a run summary (a JSON object); give its summary.json")
    return summary


def _need(section: dict[str, Any], key: str, where: str) -> Any:
    value = section.get(key)
    if value is None:
        raise PlanError(f"{where} has no {key!r}")
    return value


def fit(summary: dict[str, Any], source: str = "the summary", switch_s: float | None = None) -> Fit:
    """The run's costs as a ``Workload`` (see the module docstring); ``PlanError`` naming what
    is missing, and where, when the summary lacks a cost. ``switch_s``: seconds per lend or
    reclaim instead of the run's (measured elsewhere, for a run without lends)."""
    for section in ("trainer", "scheduler", "costs"):
        if not isinstance(summary.get(section), dict):
            raise PlanError(
                f"{source} has no {section!r} section: not a run's summary.json, or written "
                "before summaries recorded costs (run again, or `seamlessflow report` it live)"
            )
    trainer, scheduler, costs = summary["trainer"], summary["scheduler"], summary["costs"]
    at = {name: f"{source} [{name}]" for name in ("trainer", "scheduler", "costs")}
    assumed: list[str] = []

    steps = _need(trainer, "steps", at["trainer"])
    if steps < 1:
        raise PlanError(f"{at['trainer']} 'steps' is {steps}: the run trained no step")
    per_step = _need(trainer, "step seconds (mean)", at["trainer"])
    tokens = _need(trainer, "loss tokens", at["trainer"]) / steps
    linear = sum(_need(trainer, f"phase seconds: {p}", at["trainer"]) for p in LINEAR_PHASES)
    linear /= steps
    publish = trainer.get("weight publish seconds, in the step (mean)", 0.0)
    stall = trainer.get("checkpoint stall seconds per step")
    if stall is None:
        assumed.append(
            "checkpoint stall per step: not in the summary (written before it was), its mean"
            " per checkpoint (an overestimate where a checkpoint is not due every step)"
        )
        stall = trainer.get("checkpoint stall seconds (mean)", 0.0)
    trainer_devices = costs.get("trainer workers")
    if trainer_devices is None:
        assumed.append("trainer workers: not in the summary (written before they were), 1")
        trainer_devices = 1
    trainer_cost = TrainerCost(  # the phases are rank 0's, over its share of the step's tokens
        a_s=max(0.0, per_step - linear) + publish + stall,
        s_per_token=linear * trainer_devices / tokens if tokens else 0.0,
    )
    serving = trainer.get("optimizer step -> all workers serving, seconds (mean)")
    if serving is None:
        assumed.append("weight sync: not measured (no worker loaded a version), 0 s")
        serving = publish + stall
    weight_sync_s = max(0.0, serving - publish - stall)

    switch_s = _switch_s(scheduler) if switch_s is None else switch_s
    engine_switch_s = _engine_switch_s(summary.get("rollout") or {})
    if switch_s is None and engine_switch_s is not None:
        switch_s = engine_switch_s
        assumed.append(
            f"switch: no lend or reclaim in the run; the engines' pause and resume at weight "
            f"loads, {switch_s:.3g} s (a switch's engine part; where a lend also hands memory "
            "over, as on a GPU, give --switch-s)"
        )
    if switch_s is None:
        switch_s = SchedulerConfig.model_fields["switch_cost_s"].default
        assumed.append(f"switch: no lend or reclaim in the run, {switch_s:g} s (the scheduler's)")

    layout = _need(costs, "layout", at["costs"])
    if layout not in ARM_OF:
        raise PlanError(f"{at['costs']} 'layout' is {layout!r}: not one of {sorted(ARM_OF)}")
    workers = _need(costs, "rollout workers", at["costs"])
    arm = ARM_OF[layout]
    devices = max(1, workers) if arm is Arm.COLOCATED else workers + trainer_devices
    engine = fit_engine(_need(costs, "engine load", at["costs"]), at["costs"])
    calls = _need(costs, "calls per sample", at["costs"])
    turns = max(1, round(calls))
    lengths = LengthModel(  # whole turns: the tokens of a sample's calls spread over them
        median=max(1.0, _need(costs, "call tokens median", at["costs"]) * calls / turns),
        sigma=_need(costs, "call tokens log sd", at["costs"]),
        cap=_need(costs, "max tokens", at["costs"]),
    )
    agent = AgentModel(
        turns=turns,
        env_latency_s=costs.get("environment latency seconds (mean)") or 0.0,
        start_latency_s=costs.get("admission to first call seconds (mean)") or 0.0,
    )
    workload = Workload(
        lengths=lengths,
        engine=engine,
        trainer=trainer_cost,
        agent=agent,
        switch=SwitchCost(warm_s=switch_s),
        weight_sync_s=weight_sync_s,
        group_size=_need(costs, "group size", at["costs"]),
        groups_per_step=_need(costs, "groups per step", at["costs"]),
    )
    ahead = _need(costs, "steps ahead", at["costs"])
    staleness = min(_need(costs, "max staleness", at["costs"]), ahead - 1)
    return Fit(
        order=_order(costs, at["costs"], assumed),
        workload=workload,
        arm=arm,
        devices=devices,
        trainer_devices=trainer_devices,
        staleness=staleness,
        measured_s_per_step=costs.get("step seconds (steady)") or summary.get("seconds", 0) / steps,
        assumed=tuple(assumed),
    )


def _order(costs: dict[str, Any], where: str, assumed: list[str]) -> TrainerOrder:
    """The run's trainer order; the trainer's defaults, said, from a summary written before
    summaries recorded it."""
    if any(costs.get(key) is None for key in ORDER_KEYS):
        assumed.append(f"the trainer's order: not in the summary, its defaults ({TrainerOrder()})")
        return TrainerOrder()
    try:  # checked as the trainer checks its config
        config = TrainerConfig.model_validate({f: costs[key] for key, f in ORDER_KEYS.items()})
    except ValidationError as exc:
        named = {field: key for key, field in ORDER_KEYS.items()}
        bad = "; ".join(f"{named[e['loc'][0]]!r} {e['msg']}" for e in exc.errors())
        raise PlanError(f"{where} is not a trainer's order: {bad}") from exc
    return TrainerOrder.of(config)


def _switch_s(scheduler: dict[str, Any]) -> float | None:
    """Mean seconds of the run's lends and reclaims together; None without any."""
    count = total = 0.0
    for what in ("lend", "reclaim"):
        n = scheduler.get(f"{what}s") or 0
        if n and (mean := scheduler.get(f"{what} seconds (mean)")) is not None:
            count, total = count + n, total + n * mean
    return total / count if count else None


def _engine_switch_s(rollout: dict[str, Any]) -> float | None:
    """The mean of the engines' pause (a lend's engine part) and resume (a reclaim's) at the
    run's weight loads; None unless both were measured."""
    pause, resume = (rollout.get(f"engine {step} seconds (mean)") for step in ("pause", "resume"))
    return None if pause is None or resume is None else (pause + resume) / 2


def fit_engine(load: list[list[float]], where: str) -> EngineCost:
    """``a + b * batch`` through the run's ``[calls per serving engine, seconds, tokens]``
    levels: an iteration of ``batch`` residents took ``batch * seconds / tokens`` (every
    resident gains a token an iteration). Least squares weighted by tokens (where the run did
    its generating; the thin levels of a step's ramp and tail are mostly the hops to and from
    the engine), with ``a > 0`` and ``b >= 0``."""
    points = [(x, x * s / n, n) for x, s, n in load if s > 0 and n > 0]
    if not points:
        raise PlanError(f"{where} 'engine load' has no calls that generated tokens")
    w = sum(n for *_, n in points)
    mx = sum(x * n for x, _, n in points) / w
    my = sum(y * n for _, y, n in points) / w
    var = sum(n * (x - mx) ** 2 for x, _, n in points)
    b = max(0.0, sum(n * (x - mx) * (y - my) for x, y, n in points) / var) if var else 0.0
    a = my - b * mx
    if a <= 0:  # the line would cross zero: all of it per resident
        b = sum(n * x * y for x, y, n in points) / sum(n * x * x for x, _, n in points)
        a = 1e-3 * b
    top = max(64, max(round(x) for x, *_ in points))
    return EngineCost(a_s=a, b_s=b, max_batch=top)
