"""Multiplexing where the load moves (issue 22, item 2), on the emulated cluster.

``bench.shifting_load``'s ``growing`` workload scaled to the emulated cluster (``workload``
below: 16 devices, 16 groups of 8 a step, the median response 64 tokens at the first step and
256 at the last, engines with a KV budget of 4096 tokens, about 32 sequences resident at the
first step's lengths and 8 at the last's, so rollout's share of the work grows), on real processes
(``bench.pipeline``: the real scheduler, trainer, gateway, trajectory manager and NATS; the
emulated engines and trainer spend the workload's time), at the real engines' switch cost (0.1
s, ``bench/switch.py``).

For each split ``k`` (trainer devices) given:

- **static**: the disaggregated layout with partial rollout, a trainer process modelling ``k``
  devices and ``16 - k`` rollout workers;
- **multiplexed**: a trainer group of ``k`` workers (``[layout.train] count``), lent to rollout
  while they wait for a batch, and ``16 - k`` rollout workers.

Each run's times are counted from its first version (the first step, with the processes'
start-up, left out) to ``--steps`` versions later. A user tunes on the first 10% of the steps:
the split whose first ``--steps / 10`` steps were fastest is the *early* one; the split fastest
over the whole run is the *hindsight* one. The ratios are static time / multiplexed time to the
steps. The simulator runs the same protocol on the same workload, seed and trainer settings
(``--sim-only``: only it, seconds).

Usage: flock /tmp/sf-bench.lock python -m bench.shifting_emulated [--splits 2,3,4,5,6]
[--mux-splits 3,4,5] [--steps 20] [--seed 0] [--stale downweight|drop] [--sim-only]
[--results NAME]. Prints tables, writes bench/results/shifting_emulated.json or NAME (about 4
minutes a run).
"""

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench import pipeline
from bench.machine import machine
from bench.output import write_results
from bench.shifting_load import growing
from emulation.workload import SwitchCost, Workload

DEVICES = 16
ARMS = {"static": "partial_rollout", "multiplexed": "multiplexed"}
"""This bench's arm names -> ``bench.pipeline``'s (and the simulator's)."""


def workload(steps: int, seed: int) -> Workload:
    """``growing`` over ``steps + 1`` steps, a quarter of its lengths and KV budget, a quarter
    of its groups a step, the real engines' switch and ``bench.pipeline``'s weight sync."""
    w = growing(steps + 1, switch_s=0.1, seed=seed)
    return replace(
        w,
        engine=replace(w.engine, kv_tokens=w.engine.kv_tokens // 4),
        lengths=replace(w.lengths, median=w.lengths.median / 4, cap=2048),
        groups_per_step=w.groups_per_step // 4,
        switch=SwitchCost(warm_s=0.1, cold_s=0.1),
        weight_sync_s=0.5,
    )


def settings(args: argparse.Namespace, k: int) -> argparse.Namespace:
    """``bench.pipeline``'s arguments for a run at split ``k``: the trainer's admission order
    and wait bound, stale samples as ``--stale`` says, staleness 2."""
    return argparse.Namespace(
        devices=DEVICES,
        trainer_devices=k,
        workload=workload(args.steps, args.seed),
        steps=args.steps,
        warmup=1,
        staleness=2,
        stale=args.stale,
        order="admission",
        orders="admission",
        overlap_wait=pipeline.OVERLAP_WAIT_S,
        sim_path=None,
        tiny_groups=0,
        max_waiting=args.max_waiting,
    )


def times(version_at: dict[int, float], steps: int) -> dict:
    """Seconds from version 1 to the end of the first 10% of the steps, and to ``steps``
    versions later; each step's seconds (version ``v`` to ``v + 1``), to see where two runs
    part."""
    early = max(1, steps // 10)
    return {
        "early_s": round(version_at[1 + early] - version_at[1], 2),
        "time_s": round(version_at[1 + steps] - version_at[1], 2),
        "step_s": [round(version_at[v + 1] - version_at[v], 2) for v in range(1, 1 + steps)],
    }


def simulated(args: argparse.Namespace, arm: str, k: int) -> dict:
    """The simulator's run of the same protocol (its step ends counted as versions)."""
    from common.staleness import StalenessMode
    from emulation.sim import Arm as SimArm
    from emulation.sim import Cluster, Order

    s = settings(args, k)
    c = Cluster(
        s.workload,
        SimArm(ARMS[arm]),
        devices=DEVICES,
        trainer_devices=k,
        steps=args.steps + 1,
        staleness=s.staleness,
        stale=StalenessMode(s.stale),
        order=Order(s.order),
    )
    r = c.run()
    ends = {v + 1: t for v, t in enumerate(c.m.step_ends)}
    return {**times(ends, args.steps), "lends": r.lends}


def emulated(args: argparse.Namespace, arm: str, k: int, tmp: Path) -> dict:
    s = settings(args, k)
    row = asyncio.run(pipeline.run_arm(pipeline.ARMS[ARMS[arm]], "emulated", s, tmp))
    at = {int(v): t for v, t in row["version_at_s"].items()}
    keep = (
        "s_per_step",
        "idle_mean",
        "running_mean",
        "waiting_mean",
        "plane_ms_per_call",
        "order_wait_s",
        "lends",
        "reclaim_p99_s",
        "trainer_step_s",
        "wall_s",
        "cpu_busy",
        "cpu_steal",
    )
    return {**times(at, args.steps), **{key: row[key] for key in keep}}


def verdict(rows: dict[str, dict[int, dict]]) -> dict:
    """The early and hindsight static splits, the multiplexed split tuned the same way, and
    the ratios of their times (none without a static arm)."""
    static, mux = rows["static"], rows["multiplexed"]
    if not static:
        return {}
    early = min(static, key=lambda k: static[k]["early_s"])
    hindsight = min(static, key=lambda k: static[k]["time_s"])
    chosen = min(mux, key=lambda k: mux[k]["early_s"]) if mux else None
    out = {"early_split": early, "hindsight_split": hindsight, "multiplexed_split": chosen}
    if chosen is not None:
        m = mux[chosen]["time_s"]
        out["vs_early"] = round(static[early]["time_s"] / m, 3)
        out["vs_hindsight"] = round(static[hindsight]["time_s"] / m, 3)
    return out


def table(name: str, rows: dict[str, dict[int, dict]]) -> None:
    print(f"\n{name}")
    print(f"{'arm':12s} {'split':>5s} {'first 10% s':>11s} {'to steps s':>10s} {'lends':>6s}")
    for arm, by_split in rows.items():
        for k, r in sorted(by_split.items()):
            print(f"{arm:12s} {k:5d} {r['early_s']:11.1f} {r['time_s']:10.1f} {r['lends']:6.0f}")
    if not (v := verdict(rows)):
        return
    print(
        f"early split {v['early_split']}, hindsight {v['hindsight_split']}, multiplexed "
        f"{v['multiplexed_split']}: multiplexed vs static early {v.get('vs_early', '-')}x "
        f"(goal 1.15x), vs hindsight {v.get('vs_hindsight', '-')}x (goal 1.05x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--splits", default="2,3,4,5,6", help="static splits (trainer devices)")
    parser.add_argument("--mux-splits", default="3,4,5", help="multiplexed splits")
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-only", action="store_true")
    parser.add_argument(
        "--max-waiting", type=int, help="worker.max_waiting (unset: the worker's default)"
    )
    parser.add_argument(
        "--stale",
        choices=("downweight", "drop"),
        default="downweight",
        help="trainer.staleness_mode (drop, the trainer's default: a step waits for an earlier "
        "admitted group it would put past the bound, order_wait_s at most)",
    )
    parser.add_argument("--results", default="shifting_emulated.json", help="under bench/results")
    args = parser.parse_args()
    splits = {
        "static": [int(k) for k in args.splits.split(",") if k],
        "multiplexed": [int(k) for k in args.mux_splits.split(",") if k],
    }
    started = time.perf_counter()
    sim = {arm: {k: simulated(args, arm, k) for k in ks} for arm, ks in splits.items()}
    table("simulator", sim)
    results = {
        "machine": machine(),
        "setting": {**vars(args), "devices": DEVICES},
        "workload": workload(args.steps, args.seed).to_dict(),
        "simulator": {"runs": sim, **verdict(sim)},
    }
    if not args.sim_only:
        runs: dict[str, dict[int, dict]] = {arm: {} for arm in splits}
        with tempfile.TemporaryDirectory(prefix="sf-bench-shifting-") as tmp:
            for arm, ks in splits.items():
                for k in ks:
                    print(f"emulated: {arm} at {k} trainer devices ...", flush=True)
                    runs[arm][k] = emulated(args, arm, k, Path(tmp))
                    print(json.dumps(runs[arm][k]), flush=True)
        table("emulated cluster", runs)
        results["emulated"] = {"runs": runs, **verdict(runs)}
        ratio = {
            arm: {k: round(runs[arm][k]["time_s"] / sim[arm][k]["time_s"], 3) for k in ks}
            for arm, ks in splits.items()
        }
        results["emulated_over_simulated"] = ratio
        print(f"\nemulated / simulated time to the steps: {ratio}")
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results(args.results, results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
