"""``seamlessflow plan``: a layout, split and staleness for a cluster, from a short run's costs.

``fit`` reads what a run measured (its ``summary.json``: the trainer's and scheduler's numbers
and ``costs``, see ``seamlessflow.costs.run_costs``) into the simulator's ``Workload``:

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

``sweep`` then runs the simulator (``emulation.sim.simulate``) over every arm, trainer split
(``split_candidates``; the colocated layout also every device training) and staleness ``0..k``
at each device count, and the synchronous baseline once; ``recommend`` picks the most
samples/s among the arms ``seamlessflow run`` has (the fresher staleness on a tie).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.exceptions import SeamlessFlowError
from emulation.sim import Arm, TrainerOrder, simulate, split_candidates
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    SwitchCost,
    TrainerCost,
    Workload,
)
from tagsched.config import SchedulerConfig

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


@dataclass(frozen=True)
class Candidate:
    """One simulated configuration and what the simulator predicts for it."""

    arm: Arm
    devices: int
    trainer_devices: int
    staleness: int
    samples_per_s: float
    """Trained samples per second after the first quarter of the steps (start-up left out)."""
    s_per_step: float
    """Seconds per step, likewise."""
    idle: float
    """Share of all device time doing no work."""

    @property
    def layout(self) -> str:
        return LAYOUT_OF.get(self.arm, "(simulator)")


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
    keys = ("staleness mode", "overlap", "order wait seconds")
    if any(costs.get(key) is None for key in keys):
        assumed.append(f"the trainer's order: not in the summary, its defaults ({TrainerOrder()})")
        return TrainerOrder()
    try:
        return TrainerOrder.of(*(costs[key] for key in keys))
    except ValueError as exc:
        raise PlanError(f"{where} {keys[0]!r} is {costs[keys[0]]!r}: {exc}") from exc


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


def predict(
    workload: Workload,
    arm: Arm,
    devices: int,
    trainer_devices: int,
    staleness: int,
    steps: int,
    order: TrainerOrder,
) -> Candidate:
    """The simulator's prediction for one configuration, its trainer choosing as ``order``."""
    r = simulate(workload, arm, devices, steps, staleness, trainer_devices, **order.simulated())
    return Candidate(
        arm=arm,
        devices=devices,
        trainer_devices=r.trainer_devices,
        staleness=r.staleness,
        samples_per_s=r.steady_samples_per_s,
        s_per_step=workload.samples_per_step / r.steady_samples_per_s,
        idle=r.idle["all"],
    )


@dataclass(frozen=True)
class ClusterShape:
    """Devices by their role tags (``train``, ``rollout``; other tags do not matter here):
    ``both`` devices have the two, ``train`` and ``rollout`` one of them only."""

    both: int = 0
    train: int = 0
    rollout: int = 0

    @property
    def devices(self) -> int:
        return self.both + self.train + self.rollout

    def allows(self, arm: Arm, trainer: int) -> bool:
        """Whether ``arm`` can have ``trainer`` trainer devices here: every device trains and
        generates (colocated: ``trainer`` of them train; synchronous: all), or each does one
        role its tags allow, the trainer's also ``rollout`` when it is lent (multiplexed)."""
        if arm is Arm.SYNC_COLOCATED:
            return self.train == self.rollout == 0
        if arm is Arm.COLOCATED:
            return self.train == self.rollout == 0 and 1 <= trainer <= self.both
        if arm is Arm.MULTIPLEXED:
            return self.train == 0 and 1 <= trainer <= self.both
        return self.train <= trainer <= self.train + self.both and trainer < self.devices

    @classmethod
    def read(cls, path: Path) -> ClusterShape:
        """A TOML file of ``[[devices]]`` tables, each ``tags`` (a list) and ``count``."""
        try:
            tables = tomllib.loads(path.read_text()).get("devices")
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise PlanError(f"cannot read the cluster {path}: {exc}") from exc
        counts = {"both": 0, "train": 0, "rollout": 0}
        for i, table in enumerate(tables if isinstance(tables, list) else [None]):
            if not (
                isinstance(table, dict)
                and isinstance(table.get("count", 1), int)
                and isinstance(table.get("tags", []), list)
            ):
                raise PlanError(f"{path}: devices[{i}] must be a table of tags and a count")
            tags = {str(t).partition("=")[0] for t in table.get("tags", [])}
            role = {"train", "rollout"} & tags
            if role:
                key = "both" if len(role) == 2 else role.pop()
                counts[key] += table.get("count", 1)
        if not sum(counts.values()):
            raise PlanError(f"{path}: no [[devices]] tagged train or rollout")
        return cls(**counts)


def sweep(
    workload: Workload,
    cluster: ClusterShape | int,
    max_staleness: int,
    steps: int,
    order: TrainerOrder,
) -> list[Candidate]:
    """Every arm at every trainer split the cluster's tags allow (``split_candidates``, the
    fewest its train-only devices need, and for the colocated layout every device) and
    staleness ``0..max``; the synchronous arm once (every device trains, staleness 0). An int
    is that many devices tagged both."""
    if isinstance(cluster, int):
        cluster = ClusterShape(both=cluster)
    n = cluster.devices
    out = []
    if cluster.allows(Arm.SYNC_COLOCATED, n):
        out.append(predict(workload, Arm.SYNC_COLOCATED, n, n, 0, steps, order))
    splits = {*split_candidates(n), max(1, cluster.train)} if n > 1 else set()
    for arm in (Arm.COLOCATED, Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED, Arm.DISAGGREGATED):
        every = {n} if arm is Arm.COLOCATED else set()
        for split in (k for k in sorted(splits | every) if cluster.allows(arm, k)):
            for staleness in range(max_staleness + 1):
                out.append(predict(workload, arm, n, split, staleness, steps, order))
    return out


def recommend(candidates: list[Candidate]) -> Candidate:
    """The most samples/s among the arms a run can have; on a tie, the fresher staleness."""
    runnable = [c for c in candidates if c.arm in LAYOUT_OF]
    return max(runnable, key=lambda c: (round(c.samples_per_s, 6), -c.staleness))


def table(candidates: list[Candidate]) -> str:
    header = (
        f"{'layout':16s} {'arm':16s} {'devices':>7s} {'trainer':>7s} {'stale':>5s} "
        f"{'samples/s':>9s} {'s/step':>7s} {'idle':>5s}"
    )
    rows = [header]
    for c in sorted(candidates, key=lambda c: -c.samples_per_s):
        rows.append(
            f"{c.layout:16s} {c.arm:16s} {c.devices:7d} {c.trainer_devices:7d} "
            f"{c.staleness:5d} {c.samples_per_s:9.3f} {c.s_per_step:7.3f} {c.idle:5.2f}"
        )
    return "\n".join(rows)


def plot(candidates: list[Candidate], best: Candidate, path: Path) -> None:
    """Predicted samples/s by trainer devices, a line per arm, staleness and device count; the
    recommendation circled."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    lines: dict[tuple[Arm, int, int], list[Candidate]] = {}
    for c in candidates:
        lines.setdefault((c.arm, c.staleness, c.devices), []).append(c)
    for (arm, staleness, devices), points in sorted(lines.items()):
        points.sort(key=lambda c: c.trainer_devices)
        xs = [c.trainer_devices for c in points]
        ys = [c.samples_per_s for c in points]
        ax.plot(xs, ys, marker="o", label=f"{arm}, staleness {staleness}, {devices} devices")
    ax.scatter(
        [best.trainer_devices],
        [best.samples_per_s],
        s=240,
        facecolors="none",
        edgecolors="black",
        linewidths=2,
        label="recommended",
        zorder=3,
    )
    ax.set_xlabel("trainer devices")
    ax.set_ylabel("predicted samples/s")
    ax.set_title("seamlessflow plan: predicted throughput per layout, split and staleness")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("summary", type=Path, help="a run's summary.json (seamlessflow run / report)")
    p.add_argument(
        "--devices",
        type=int,
        nargs="+",
        help="device counts of the cluster to plan for (default: the run's own)",
    )
    p.add_argument(
        "--cluster",
        type=Path,
        help="TOML: [[devices]] tables of tags and count (instead of --devices: which devices "
        "may train, generate, or be lent)",
    )
    p.add_argument("--max-staleness", type=int, default=2, help="staleness bounds 0..this")
    p.add_argument("--steps", type=int, default=30, help="simulated trainer steps per candidate")
    p.add_argument("--plot", type=Path, help="write the predictions as a PNG here")
    p.add_argument(
        "--switch-s",
        type=float,
        help="seconds per lend or reclaim (default: the run's; without lends, the scheduler's "
        "assumption)",
    )


def main(args: argparse.Namespace) -> int:
    """Fit, sweep, print the table and the recommendation; ``PlanError`` on bad input."""
    if args.max_staleness < 0 or args.steps < 2:
        raise PlanError("--max-staleness must be >= 0 and --steps >= 2")
    if args.switch_s is not None and args.switch_s < 0:
        raise PlanError(f"--switch-s must be >= 0, got {args.switch_s}")
    found = fit(load_summary(args.summary), str(args.summary), args.switch_s)
    if args.cluster:
        clusters = [ClusterShape.read(args.cluster)]
    else:
        clusters = [ClusterShape(both=n) for n in args.devices or [found.devices]]
    if min(c.devices for c in clusters) < 1:
        raise PlanError(f"--devices must be >= 1, got {min(c.devices for c in clusters)}")
    w = found.workload
    print(
        f"fitted from {args.summary} ({found.arm} on {found.devices} devices, measured "
        f"{found.measured_s_per_step:.3f} s/step):"
    )
    print(
        f"  engine: {w.engine.a_s:.4g} + {w.engine.b_s:.4g} * batch s/iteration; trainer: "
        f"{w.trainer.a_s:.4g} + {w.trainer.s_per_token:.4g} * tokens s/step; weight sync "
        f"{w.weight_sync_s:.3g} s; switch {w.switch.warm_s:.3g} s"
    )
    print(
        f"  lengths: median {w.lengths.median:g}, log sd {w.lengths.sigma:.3g}, cap "
        f"{w.lengths.cap}; {w.agent.turns} turns, {w.agent.env_latency_s:.3g} s between, "
        f"{w.agent.start_latency_s:.3g} s from admission to the first; "
        f"{w.groups_per_step} x {w.group_size} samples a step; the trainer: {found.order}"
    )
    for note in found.assumed:
        print(f"  assumed: {note}")
    candidates = [
        c for n in clusters for c in sweep(w, n, args.max_staleness, args.steps, found.order)
    ]
    if not candidates:
        raise PlanError("the cluster's tags allow no layout")
    print(table(candidates))
    best = recommend(candidates)
    print(
        f"recommended: [layout] kind = {best.layout!r}, trainer on {best.trainer_devices} of "
        f"{best.devices} devices, staleness {best.staleness} (trainer.max_staleness = "
        f"{best.staleness}, scheduler.steps_ahead = {best.staleness + 1}): "
        f"{best.samples_per_s:.3f} samples/s, {best.s_per_step:.3f} s/step, idle {best.idle:.0%}"
    )
    if args.plot:
        plot(candidates, best, args.plot)
        print(f"plot: {args.plot}")
    return 0


def predictions(found: Fit, steps: int) -> dict[str, Candidate]:
    """What the fit predicts for each layout at the run's own shape (devices, split,
    staleness), as ``seamlessflow run`` lays it out: the colocated layout on its workers (the
    run's trainer workers train, one if the run was not colocated), the disaggregated and
    multiplexed ones with the run's trainer workers besides its rollout workers if it was one
    of them (``[layout.train] count`` trainer workers, in either), else one."""
    own = found.trainer_devices
    workers = found.devices if found.arm is Arm.COLOCATED else found.devices - own
    out = {}
    for arm, layout in LAYOUT_OF.items():
        trainer = own if arm is found.arm or Arm.COLOCATED not in (arm, found.arm) else 1
        n = max(1, workers) if arm is Arm.COLOCATED else workers + trainer
        trainer = min(n, trainer)
        out[layout] = predict(found.workload, arm, n, trainer, found.staleness, steps, found.order)
    return out
