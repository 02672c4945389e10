"""``seamlessflow plan``: a layout, split and staleness for a cluster, from a short run's costs.

``emulation.fit`` reads what the run measured into the simulator's ``Workload`` and the run's
own trainer order; ``sweep`` then runs the simulator (``emulation.sim.simulate``) over every arm,
trainer split (``split_candidates``; the colocated layout also every device training) and
staleness ``0..k`` at each device count, and the synchronous baseline once; ``recommend`` picks
the most samples/s among the arms ``seamlessflow run`` has (the fresher staleness on a tie).
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass
from pathlib import Path

from emulation.fit import LAYOUT_OF, Fit, PlanError, fit, load_summary
from emulation.sim import Arm, TrainerOrder, simulate, split_candidates
from emulation.workload import Workload


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
    thrown: float
    """Share of the generated tokens thrown away (stale in drop mode, aborted)."""
    bias: float
    """Mean length of the trained samples over the drawn mean: under 1, long ones were lost."""

    @property
    def layout(self) -> str:
        return LAYOUT_OF.get(self.arm, "(simulator)")


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
        s_per_step=r.steady_s_per_step,
        idle=r.idle["all"],
        thrown=r.aborted_token_fraction,
        bias=r.length_bias,
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


SWITCHES = {Arm.PARTIAL_ROLLOUT: 0, Arm.MULTIPLEXED: 1, Arm.COLOCATED: 2}
"""How much of a layout's work is role switches: none, lends, every step."""


def recommend(candidates: list[Candidate]) -> Candidate:
    """The most samples/s among the arms a run can have; on a tie, the fresher staleness, then
    the layout with fewer role switches (a trainer computing ahead is not lent beside rollout
    workers, so with ``trainer.overlap`` the layouts often tie)."""
    runnable = [c for c in candidates if c.arm in LAYOUT_OF]
    return max(runnable, key=lambda c: (round(c.samples_per_s, 6), -c.staleness, -SWITCHES[c.arm]))


def table(candidates: list[Candidate]) -> str:
    header = (
        f"{'layout':16s} {'arm':16s} {'devices':>7s} {'trainer':>7s} {'stale':>5s} "
        f"{'samples/s':>9s} {'s/step':>7s} {'idle':>5s} {'thrown':>6s} {'bias':>5s}"
    )
    rows = [header]
    for c in sorted(candidates, key=lambda c: -c.samples_per_s):
        rows.append(
            f"{c.layout:16s} {c.arm:16s} {c.devices:7d} {c.trainer_devices:7d} "
            f"{c.staleness:5d} {c.samples_per_s:9.3f} {c.s_per_step:7.3f} "
            f"{c.idle:5.2f} {c.thrown:6.1%} {c.bias:5.2f}"
        )
    return "\n".join(rows)


def plot(candidates: list[Candidate], best: Candidate, path: Path) -> None:
    """Predicted samples/s by trainer devices, a panel per device count, a line (a colour) per
    arm and staleness; the recommendation circled."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    counts = sorted({c.devices for c in candidates})
    fig, axes = plt.subplots(1, len(counts), figsize=(4.5 * len(counts) + 3, 4.5), squeeze=False)
    lines: dict[tuple[Arm, int, int], list[Candidate]] = {}
    for c in candidates:
        lines.setdefault((c.arm, c.staleness, c.devices), []).append(c)
    kinds = sorted({(arm, staleness) for arm, staleness, _ in lines})
    colour = {kind: plt.get_cmap("tab20")(i % 20) for i, kind in enumerate(kinds)}
    for (arm, staleness, devices), points in sorted(lines.items()):
        points.sort(key=lambda c: c.trainer_devices)
        ax = axes[0][counts.index(devices)]
        ax.plot(
            [c.trainer_devices for c in points],
            [c.samples_per_s for c in points],
            marker="o",
            color=colour[arm, staleness],
            label=f"{arm}, staleness {staleness}",
        )
    best_ax = axes[0][counts.index(best.devices)]
    best_ax.scatter(
        [best.trainer_devices],
        [best.samples_per_s],
        s=240,
        facecolors="none",
        edgecolors="black",
        linewidths=2,
        label="recommended",
        zorder=3,
    )
    for ax, devices in zip(axes[0], counts, strict=True):
        ax.set_title(f"{devices} devices")
        ax.set_xlabel("trainer devices")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("predicted samples/s")
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="center right")
    fig.suptitle("seamlessflow plan: predicted throughput per layout, split and staleness")
    fig.tight_layout(rect=(0, 0, 1 - 3 / (4.5 * len(counts) + 3), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
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
        f"{w.groups_per_step} x {w.group_size} samples a step"
    )
    print(f"  the trainer's order: {found.order}")
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
        f"{best.samples_per_s:.3f} samples/s, {best.s_per_step:.3f} s/step, idle {best.idle:.0%}; "
        f"{best.thrown:.1%} of the generated tokens thrown away, length bias {best.bias:.2f}"
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
