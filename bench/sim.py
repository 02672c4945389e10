"""The cluster simulator's arms and sweeps (``emulation.sim``), with tables, JSON and plots.

Arms at equal devices, staleness bound, length sampler and trained samples: ``sync_colocated``;
``disaggregated`` (async, the rollout side drains and syncs together) at the best static
trainer/rollout split found by a sweep; ``partial_rollout`` (that plus in-place weight updates);
``multiplexed`` (that plus lending the trainer's devices); each async arm at its own best split
(swept on seed 0), plus ``multiplexed_static``: lending at partial_rollout's split. Each point
runs ``--seeds`` seeds; gains are per-seed ratios of trained samples a second over ``--steps``
steps (mean, min..max; in ``drop`` mode a step trains fewer samples where some were stale, so
they are not ratios of time to the steps).

Issue 22 item 1, in the main scenario and drop mode: which groups a step takes (``ORDERS``:
completion order, the simulator's trainer before; admission order, the real trainer's; overlap,
admission order with the complete groups computed while the step waits), the partial_rollout
and multiplexed arms each at its own split, and overlap's wait bound swept.

Sweeps around the main (agentic, long-tailed) scenario: switch cost (0.1 to 50 s, with the
trainer's idle window, the lends per step, and the multiplexed arm's device idle and reclaim p99
over its step: the crossover), tail heaviness (sigma), rollout/train work ratio (1 to 6),
staleness bound (0 to 4); and a scale check from 8 to 1024 devices. verl's published setting,
with its own rhythm: ``bench/verl.py``.

Usage: python -m bench.sim [--seeds 3] [--steps 20] [--quick]  (about 10 min on one core).
Prints tables, writes bench/results/sim.json and docs/images/sim-*.png. ``--order-only``: the
issue 22 section alone (about 3 min), to bench/results/sim-order.json and sim-order.png.
"""

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.machine import machine
from bench.output import RESULTS, write_results
from common.staleness import StalenessMode
from emulation.sim import Arm, Order, best_split, simulate
from emulation.sim.order import ORDER_WAIT_S
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    SwitchCost,
    TrainerCost,
    Workload,
)
from tagsched.config import SchedulerConfig

CROSSOVER_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
"""Switch costs (lend or reclaim, seconds) of the crossover at a fixed split."""
IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"

STATIC_LENDING = "multiplexed_static"
"""Diagnostic arm: lending at the static split (the multiplexed arm sweeps its own split)."""

ARMS = (*(str(a) for a in Arm), STATIC_LENDING)

STREAMING = "streaming (disaggregated / sync_colocated)"
PARTIAL = "partial rollout (partial_rollout / disaggregated)"
MULTIPLEXING = "multiplexing (multiplexed / partial_rollout)"
TOTAL = "total (multiplexed / sync_colocated)"
LENDING_ONLY = "lending at the static split (multiplexed_static / partial_rollout)"
GAINS = {
    STREAMING: ("disaggregated", "sync_colocated"),
    PARTIAL: ("partial_rollout", "disaggregated"),
    MULTIPLEXING: ("multiplexed", "partial_rollout"),
    TOTAL: ("multiplexed", "sync_colocated"),
    LENDING_ONLY: (STATIC_LENDING, "partial_rollout"),
}


OVERLAP_WAIT_S = 25.0
"""The ``overlap`` order's bound on the trainer's idle wait for an earlier admitted group in the
main scenario (the order section sweeps it)."""
ORDERS = {
    "completion (simulator before)": (Order.COMPLETION, ORDER_WAIT_S),
    "admission (real trainer)": (Order.ADMISSION, ORDER_WAIT_S),
    "overlap (new)": (Order.OVERLAP, OVERLAP_WAIT_S),
}
"""Issue 22 item 1's arms: which groups a step takes, and the bound on its wait."""
WAIT_SWEEP_S = (0.0, 10.0, 20.0, 25.0, 30.0, 60.0)


def workload(
    *,
    ratio: float = 3.0,
    sigma: float = 0.99,
    switch_s: float = 5.0,
    median: float = 256.0,
    cap: int = 2048,
    turns: int = 3,
    env_s: float = 2.0,
    max_batch: int = 16,
    group_size: int = 8,
    groups_per_step: int = 32,
    seed: int = 0,
) -> Workload:
    """A workload whose rollout/train work ratio is ``ratio``: decoding a token at a full batch
    costs ``ratio`` times the device time of training on it (the linear part)."""
    engine = EngineCost(a_s=0.02, b_s=0.0005, prefill_s_per_token=2e-5, max_batch=max_batch)
    decode_per_token = engine.iteration_s(max_batch) / max_batch
    return Workload(
        lengths=LengthModel(median=median, sigma=sigma, cap=cap, group_corr=0.5),
        engine=engine,
        trainer=TrainerCost(a_s=2.0, s_per_token=decode_per_token / ratio),
        agent=AgentModel(turns=turns, env_latency_s=env_s),
        switch=SwitchCost(warm_s=switch_s, cold_s=6 * switch_s),
        weight_sync_s=2.0,
        group_size=group_size,
        groups_per_step=groups_per_step,
        seed=seed,
    )


def point(
    w: Workload,
    devices: int,
    steps: int,
    staleness: int,
    seeds: int,
    stale: StalenessMode = StalenessMode.DROP,
) -> dict:
    """Every arm on ``seeds`` seeds, each async arm at its own best split (swept on seed 0),
    and lending at the partial_rollout arm's split."""
    splits = {"sync_colocated": devices}
    for arm in (Arm.DISAGGREGATED, Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED, Arm.COLOCATED):
        splits[str(arm)] = best_split(w, devices, steps, staleness, arm=arm, stale=stale)
    splits[STATIC_LENDING] = splits["partial_rollout"]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed in range(seeds):
        ws = replace(w, seed=seed)
        for arm in ARMS:
            kind = "multiplexed" if arm == STATIC_LENDING else arm
            r = simulate(ws, kind, devices, steps, staleness, splits[arm], stale=stale)
            r = r.to_dict()
            runs[arm].append(r)
    gains = {}
    for name, (num, den) in GAINS.items():
        # trained samples a second: in drop mode a step trains fewer where more were stale
        ratios = [
            n["samples_per_s"] / d["samples_per_s"]
            for n, d in zip(runs[num], runs[den], strict=True)
        ]
        gains[name] = {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios)}
    summary = {arm: _summary(rs) for arm, rs in runs.items()}
    return {
        "split": splits["partial_rollout"],
        "mux_split": splits["multiplexed"],
        "splits": splits,
        "gains": gains,
        "arms": summary,
        "runs": runs,
    }


def _summary(rs: list[dict]) -> dict:
    keys = (
        "time_s",
        "samples_per_s",
        "steady_samples_per_s",
        "tokens_per_s",
        "staleness_mean",
        "staleness_p99",
        "reclaim_p50_s",
        "reclaim_p99_s",
        "step_s_mean",
        "trainer_wait_s_mean",
        "order_wait_s_per_step",
        "aborted_token_fraction",
        "length_bias",
        "mean_batch",
        "lends",
    )
    out = {k: statistics.fmean(r[k] for r in rs) for k in keys}
    out["staleness_max"] = max(r["staleness_max"] for r in rs)
    out["idle"] = {p: statistics.fmean(r["idle"][p] for r in rs) for p in rs[0]["idle"]}
    return out


def order_point(w: Workload, devices: int, steps: int, staleness: int, seeds: int) -> dict:
    """Issue 22 item 1, in drop mode: ``partial_rollout`` and ``multiplexed`` with each of
    ``ORDERS``, each at its own best split (swept on seed 0); samples/s per seed over the
    completion order's; and the overlap order's wait bound swept at its split."""
    rows: dict[str, dict] = {}
    for arm in (Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED):
        base = None
        for name, (order, wait_s) in ORDERS.items():
            kw = {"order": order, "order_wait_s": wait_s}
            split = best_split(w, devices, steps, staleness, arm=arm, **kw)
            runs = [
                simulate(replace(w, seed=seed), arm, devices, steps, staleness, split, **kw)
                for seed in range(seeds)
            ]
            base = base or runs
            ratios = [r.samples_per_s / b.samples_per_s for r, b in zip(runs, base, strict=True)]
            rows[f"{arm} / {name}"] = {
                "arm": str(arm),
                "order": str(order),
                "order_wait_s": wait_s,
                "split": split,
                "vs_completion": {
                    "mean": statistics.fmean(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                },
                "arms": _summary([r.to_dict() for r in runs]),
            }
    overlap = rows[f"{Arm.PARTIAL_ROLLOUT} / overlap (new)"]
    sweep = []
    for wait_s in WAIT_SWEEP_S:
        runs = [
            simulate(
                replace(w, seed=seed),
                Arm.PARTIAL_ROLLOUT,
                devices,
                steps,
                staleness,
                overlap["split"],
                order=Order.OVERLAP,
                order_wait_s=wait_s,
            ).to_dict()
            for seed in range(seeds)
        ]
        sweep.append({"order_wait_s": wait_s, "arms": _summary(runs)})
    return {"rows": rows, "wait_sweep": {"split": overlap["split"], "rows": sweep}}


def print_order(p: dict) -> None:
    print("\n== issue 22 item 1: drop mode, which groups a step takes (each at its own best split)")
    print(
        f"{'arm / order':<48}{'split':>6}{'samples/s':>10}{'x compl (min..max)':>19}{'abort':>7}"
        f"{'bias':>6}"
        f"{'stale':>7}{'wait/step s':>12}{'idle all':>9}"
    )
    for name, r in p["rows"].items():
        s, g = r["arms"], r["vs_completion"]
        print(
            f"{name:<48}{r['split']:>6}{s['samples_per_s']:>10.2f}"
            f"{g['mean']:>7.2f}x ({g['min']:.2f}..{g['max']:.2f})"
            f"{s['aborted_token_fraction']:>7.3f}"
            f"{s['length_bias']:>6.3f}{s['staleness_mean']:>7.2f}"
            f"{s['order_wait_s_per_step']:>12.1f}{s['idle']['all']:>9.3f}"
        )
    sweep = p["wait_sweep"]
    print(f"\n== overlap: the bound on the trainer's idle wait (partial_rollout, {sweep['split']})")
    print(f"{'wait s':>7}{'samples/s':>10}{'abort':>7}{'bias':>6}{'wait/step s':>12}")
    for row in sweep["rows"]:
        s = row["arms"]
        print(
            f"{row['order_wait_s']:>7g}{s['samples_per_s']:>10.2f}"
            f"{s['aborted_token_fraction']:>7.3f}{s['length_bias']:>6.3f}"
            f"{s['order_wait_s_per_step']:>12.1f}"
        )


# -- printing ------------------------------------------------------------------------------------
def print_point(title: str, p: dict) -> None:
    splits = ", ".join(f"{a} {k}" for a, k in p["splits"].items() if a != "sync_colocated")
    print(f"\n== {title} (trainer devices: {splits})")
    print(
        f"{'arm':<16}{'time s':>9}{'samples/s':>11}{'tok/s':>9}{'idle all':>9}{'idle tr':>8}"
        f"{'idle ro':>8}{'stale':>7}{'p99':>5}{'recl p99':>9}{'abort':>7}{'bias':>6}{'lends':>7}"
    )
    for arm, s in p["arms"].items():
        idle = s["idle"]
        print(
            f"{arm:<16}{s['time_s']:>9.0f}{s['samples_per_s']:>11.2f}{s['tokens_per_s']:>9.0f}"
            f"{idle['all']:>9.3f}{idle['train']:>8.3f}{idle.get('rollout', float('nan')):>8.3f}"
            f"{s['staleness_mean']:>7.2f}{s['staleness_p99']:>5.0f}{s['reclaim_p99_s']:>9.2f}"
            f"{s['aborted_token_fraction']:>7.3f}{s['length_bias']:>6.2f}{s['lends']:>7.1f}"
        )
    for name, g in p["gains"].items():
        print(f"  {name:<68} {g['mean']:.2f}x  ({g['min']:.2f}..{g['max']:.2f})")


def print_sweep(name: str, rows: list[dict]) -> None:
    print(f"\n== sweep: {name}")
    cols = list(GAINS)
    head = "".join(f"{c.split(' (')[0][:15]:>16}" for c in cols)
    print(f"{name:>10}{'splits':>8}{head}{'idle mux':>10}")
    for r in rows:
        p = r["point"]
        gains = "".join(f"{p['gains'][c]['mean']:>15.2f}x" for c in cols)
        splits = f"{p['split']}/{p['mux_split']}"
        idle = p["arms"]["multiplexed"]["idle"]["all"]
        print(f"{r['value']:>10g}{splits:>8}{gains}{idle:>10.3f}")


# -- plots ---------------------------------------------------------------------------------------
def plot(results: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    written = []

    main = results["main"]
    arms = list(main["arms"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = main["arms"]["sync_colocated"]["samples_per_s"]
    ax1.bar(arms, [main["arms"][a]["samples_per_s"] / base for a in arms], color="tab:blue")
    ax1.set_ylabel("trained samples/s (x sync_colocated)")
    ax1.set_title("throughput per arm")
    width = 0.27
    for i, pool in enumerate(("all", "train", "rollout")):
        vals = [main["arms"][a]["idle"].get(pool, 0.0) for a in arms]
        ax2.bar([x + (i - 1) * width for x in range(len(arms))], vals, width, label=pool)
    ax2.set_xticks(range(len(arms)), arms)
    ax2.axhline(0.05, color="grey", ls="--", lw=1, label="5% goal")
    ax2.set_ylabel("idle fraction of device time")
    ax2.set_title("idle per pool")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"simulated {results['main_setting']['devices']} devices, agentic long-tailed")
    fig.tight_layout()
    path = IMAGES / "sim-arms.png"
    fig.savefig(path, dpi=110)
    written.append(str(path))
    plt.close(fig)

    cross = results["crossover"]
    rows = cross["rows"]
    xs = [r["switch_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    fixed = [
        r["arms"]["multiplexed"]["samples_per_s"] / r["arms"]["partial_rollout"]["samples_per_s"]
        for r in rows
    ]
    steady = [
        r["arms"]["multiplexed"]["steady_samples_per_s"]
        / r["arms"]["partial_rollout"]["steady_samples_per_s"]
        for r in rows
    ]
    ax.plot(xs, fixed, "o-", label=f"lending / static, both at {cross['split']} trainer devices")
    ax.plot(xs, steady, "s--", label="same, steady state (first quarter of steps excluded)")
    own = results["sweeps"]["switch_s"]
    ax.plot(
        [r["value"] for r in own],
        [r["point"]["gains"][MULTIPLEXING]["mean"] for r in own],
        "d-.",
        label="multiplexed (own best split) / best static split",
    )
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("switch cost, each of lend and reclaim (s)")
    ax.set_ylabel("throughput ratio")
    ax2 = ax.twinx()
    steps = results["main_setting"]["steps"]
    lends = [r["arms"]["multiplexed"]["lends"] / steps / cross["split"] for r in rows]
    ax2.plot(xs, lends, "^:", color="tab:red", label="lends per step per trainer device")
    ax2.set_ylabel("lends per step per trainer device", color="tab:red")
    window = statistics.fmean(r["arms"]["partial_rollout"]["trainer_wait_s_mean"] for r in rows)
    gain = SchedulerConfig.model_fields["lend_gain"].default
    edge = window / (2 * gain)
    ax.axvline(edge, color="tab:green", ls="--", lw=1)
    ax.text(
        edge, max(fixed), f" idle window {window:.0f} s / (2 x gain {gain:g})", color="tab:green"
    )
    lines = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower left", fontsize=7)
    ax.set_title("lending pays while a switch there and back is shorter than the idle window")
    fig.tight_layout()
    path = IMAGES / "sim-crossover.png"
    fig.savefig(path, dpi=110)
    written.append(str(path))
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, label) in zip(
        axes,
        (
            ("sigma", "tail heaviness sigma"),
            ("ratio", "rollout/train work ratio"),
            ("staleness", "staleness bound"),
        ),
        strict=True,
    ):
        rows = results["sweeps"][key]
        xs = [r["value"] for r in rows]
        for arm in ("disaggregated", "partial_rollout", "multiplexed"):
            ys = [
                r["point"]["arms"][arm]["samples_per_s"]
                / r["point"]["arms"]["sync_colocated"]["samples_per_s"]
                for r in rows
            ]
            ax.plot(xs, ys, "o-", label=arm)
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("x sync_colocated")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = IMAGES / "sim-sweeps.png"
    fig.savefig(path, dpi=110)
    written.append(str(path))
    plt.close(fig)
    return written


def plot_order(order: dict) -> str:
    """Samples/s against the tokens thrown away: the overlap order's wait bound swept, and each
    order's arm (issue 22 item 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    sweep = order["wait_sweep"]
    rows = [r["arms"] for r in sweep["rows"]]
    ax.plot(
        [r["aborted_token_fraction"] for r in rows],
        [r["samples_per_s"] for r in rows],
        "o-",
        color="tab:green",
        label=f"partial_rollout, overlap at {sweep['split']} trainer devices: wait bound (s)",
    )
    for row, r in zip(sweep["rows"], rows, strict=True):
        ax.annotate(f"{row['order_wait_s']:g}", (r["aborted_token_fraction"], r["samples_per_s"]))
    for (name, row), marker in zip(order["rows"].items(), "s^DvP*", strict=False):
        s = row["arms"]
        ax.plot(s["aborted_token_fraction"], s["samples_per_s"], marker, ls="", label=name)
    ax.axvline(0.03, color="grey", ls="--", lw=1, label="3% of tokens thrown away")
    ax.set_xlabel("generated tokens thrown away (stale groups dropped)")
    ax.set_ylabel("trained samples/s")
    ax.set_title("drop mode: which groups a step takes, and how long it waits")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = IMAGES / "sim-order.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _slim(results: dict) -> dict:
    """The JSON keeps per-seed runs of the main point only (sweeps keep summaries)."""
    for rows in results["sweeps"].values():
        for row in rows:
            row["point"].pop("runs", None)
    for row in results["scale"]:
        for run in row["arms"].values():
            run.pop("wall_s", None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one seed, fewer sweep points")
    parser.add_argument(
        "--order-only",
        action="store_true",
        help="only the order section (issue 22 item 1), written to bench/results/sim-order.json",
    )
    args = parser.parse_args()
    seeds = 1 if args.quick else args.seeds
    started = time.perf_counter()
    n, steps, bound = args.devices, args.steps, args.staleness
    if args.order_only:
        order = order_point(workload(), n, steps, bound, seeds)
        print_order(order)
        setting = {"devices": n, "steps": steps, "staleness": bound, "seeds": seeds}
        image = plot_order(order)
        out = write_results(
            "sim-order.json",
            {"machine": machine(), "main_setting": setting, "order": order, "images": [image]},
        )
        print(f"\nwrote {out} in {time.perf_counter() - started:.0f}s")
        return

    results: dict = {
        "machine": machine(),
        "main_setting": {"devices": n, "steps": steps, "staleness": bound, "seeds": seeds},
    }
    base = workload()
    results["main_workload"] = base.to_dict()
    results["main"] = point(base, n, steps, bound, seeds)
    print_point(f"main: {n} devices, staleness {bound}, agentic long-tailed", results["main"])
    results["order"] = order_point(base, n, steps, bound, seeds)
    print_order(results["order"])

    sweeps = {
        "switch_s": [0.1, 0.3, 0.5, 1.5, 5.0, 15.0, 50.0],  # 0.1-0.3: real engines' switches
        "sigma": [0.5, 0.99, 1.5],
        "ratio": [1.0, 2.0, 3.0, 4.0, 6.0],
        "staleness": [0, 1, 2, 3, 4],
    }
    if args.quick:
        sweeps = {k: [v[0], v[len(v) // 2], v[-1]] for k, v in sweeps.items()}
    results["sweeps"] = {}
    for key, values in sweeps.items():
        rows = []
        for v in values:
            if key == "staleness":
                p = point(base, n, steps, int(v), seeds)
            else:
                p = point(workload(**{key: v}), n, steps, bound, seeds)
            rows.append({"value": v, "point": p})
        results["sweeps"][key] = rows
        print_sweep(key, rows)
    # the crossover: lending at one fixed split with a real idle window, switch cost swept
    split = results["sweeps"]["switch_s"][0]["point"]["mux_split"]
    rows = []
    for switch_s in CROSSOVER_S:
        w = workload(switch_s=switch_s)
        runs = {a: [] for a in ("partial_rollout", "multiplexed")}
        for seed in range(seeds):
            for arm in runs:
                r = simulate(replace(w, seed=seed), arm, n, steps, bound, split)
                runs[arm].append(r.to_dict())
        rows.append({"switch_s": switch_s, "arms": {a: _summary(rs) for a, rs in runs.items()}})
    results["crossover"] = {"split": split, "rows": rows}
    print(f"\n== crossover at a fixed split of {split} trainer devices (lending on/off)")
    print(
        f"{'switch s':>9}{'idle window s':>15}{'4 x switch':>12}{'lends/step':>12}"
        f"{'mux/static':>12}{'steady':>8}"
    )
    for row in rows:
        static, mux = row["arms"]["partial_rollout"], row["arms"]["multiplexed"]
        print(
            f"{row['switch_s']:>9g}{static['trainer_wait_s_mean']:>15.1f}"
            f"{4 * row['switch_s']:>12.1f}{mux['lends'] / steps:>12.2f}"
            f"{mux['samples_per_s'] / static['samples_per_s']:>11.2f}x"
            f"{mux['steady_samples_per_s'] / static['steady_samples_per_s']:>7.2f}x"
        )

    print("\n== switch cost sweep: multiplexed at its own split vs the best static split")
    print(
        f"{'switch s':>9}{'idle window s':>15}{'lends/step':>12}{'lend@static':>13}"
        f"{'steady':>8}{'mux own':>9}{'mux idle':>10}{'reclaim p99/step':>18}"
    )
    for r in results["sweeps"]["switch_s"]:
        a, g = r["point"]["arms"], r["point"]["gains"]
        static, ref, mux = a[STATIC_LENDING], a["partial_rollout"], a["multiplexed"]
        print(
            f"{r['value']:>9g}{ref['trainer_wait_s_mean']:>15.1f}"
            f"{static['lends'] / steps:>12.2f}{g[LENDING_ONLY]['mean']:>12.2f}x"
            f"{static['steady_samples_per_s'] / ref['steady_samples_per_s']:>7.2f}x"
            f"{g[MULTIPLEXING]['mean']:>8.2f}x{mux['idle']['all']:>10.3f}"
            f"{mux['reclaim_p99_s'] / mux['step_s_mean']:>18.3f}"
        )

    # scale: 8 to 1024 devices, one group per device per step, one seed, each arm's best split
    results["scale"] = []
    print("\n== scale: one group per device per step, 10 steps, seed 0")
    print(
        f"{'devices':>8}{'splits':>10}{'partial/sync':>14}{'mux/partial':>13}"
        f"{'idle mux':>10}{'wall s':>8}"
    )
    for devices in (8, 32, 128, 1024):
        w = workload(groups_per_step=devices)
        t0 = time.perf_counter()
        runs = {
            arm: simulate(w, arm, devices, 10, bound)
            for arm in ("sync_colocated", "partial_rollout", "multiplexed")
        }
        row = {"devices": devices, "arms": {a: r.to_dict() for a, r in runs.items()}}
        row["wall_s"] = time.perf_counter() - t0
        results["scale"].append(row)
        s, p, m = runs.values()
        splits = f"{p.trainer_devices}/{m.trainer_devices}"
        print(
            f"{devices:>8}{splits:>10}{p.samples_per_s / s.samples_per_s:>13.2f}x"
            f"{m.samples_per_s / p.samples_per_s:>12.2f}x{m.idle['all']:>10.3f}"
            f"{row['wall_s']:>8.0f}"
        )

    results["wall_s"] = time.perf_counter() - started
    results["images"] = [*plot(results), plot_order(results["order"])]
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "sim.json"
    out.write_text(json.dumps(_slim(results), indent=1))
    print(f"\nwrote {out} and {', '.join(results['images'])} in {results['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
