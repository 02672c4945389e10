"""The three layouts of `seamlessflow run` side by side: disaggregated, multiplexed, colocated.

Each runs the quickstart (tiny model, the built-in arithmetic task, the quickstart's settings)
for ``--steps`` trainer steps on an embedded broker, one layout after the other, ``--rounds``
times in turn (so noise on this shared machine falls on all of them alike). Per layout: seconds
per trainer step (RL only, after warm start and process start), the reward of the first and last
10 policy versions, samples trained and stale-dropped, and the scheduler's lends, reclaims and
their mean latency, read from each run's ``summary.json``. Ratios are to disaggregated.

Usage: python -m bench.layouts [--steps 60] [--rounds 1] [--layouts ...]  (about 2 min per
layout and round on 2 cores). Prints a table and writes bench/results/layouts.json (with fewer
layouts: layouts-<them>.json; ratios then to the first).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import machine
from bench.output import write_results

LAYOUTS = ("disaggregated", "multiplexed", "colocated")


def run_layout(layout: str, steps: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{layout}.toml"
    config.write_text(
        f'run = "bench-{layout}-{int(time.time())}"\noutput_dir = "{out / layout}"\n'
        f'[layout]\nkind = "{layout}"\n[stop]\nmax_steps = {steps}\nmax_seconds = 1800\n'
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "run", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise SystemExit(f"{layout} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((out / layout / "summary.json").read_text())
    trainer, scheduler = summary["trainer"], summary["scheduler"]
    return {
        "wall_s": round(time.monotonic() - started, 1),
        "rl_s": summary["seconds"],
        "steps": summary["steps"],
        "s_per_step": summary["seconds"] / max(1, summary["steps"]),
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "samples_trained": trainer.get("samples trained", 0),
        "stale_dropped": trainer.get("samples stale_dropped", 0),
        "lends": scheduler.get("lends", 0),
        "lend_s": scheduler.get("lend seconds (mean)"),
        "reclaims": scheduler.get("reclaims", 0),
        "reclaim_s": scheduler.get("reclaim seconds (mean)"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
    loadavg_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sf-bench-layouts-") as tmp:
        for round_ in range(args.rounds):
            for layout in args.layouts:
                print(f"round {round_ + 1}/{args.rounds}: {layout} ...", flush=True)
                runs[layout].append(run_layout(layout, args.steps, Path(tmp) / str(round_)))
    base = statistics.median(r["s_per_step"] for r in runs[args.layouts[0]])
    rows = {}
    for layout, results in runs.items():
        per_step = statistics.median(r["s_per_step"] for r in results)
        rows[layout] = {
            "s_per_step": round(per_step, 3),
            "ratio_to_disaggregated": round(per_step / base, 3),
            "runs": results,
        }
    header = f"{'layout':14s} {'s/step':>7s} {'ratio':>6s} {'reward first->last':>19s} "
    header += f"{'dropped':>7s} {'lends':>5s} {'lend s':>7s} {'reclaim s':>9s}"
    print(header)
    for layout, row in rows.items():
        last = row["runs"][-1]
        rise = f"{last['reward_first']:.3f} -> {last['reward_last']:.3f}"
        lend_s = f"{last['lend_s']:.3f}" if last["lend_s"] else "-"
        reclaim_s = f"{last['reclaim_s']:.3f}" if last["reclaim_s"] else "-"
        print(
            f"{layout:14s} {row['s_per_step']:7.3f} {row['ratio_to_disaggregated']:6.3f} "
            f"{rise:>19s} {last['stale_dropped']:7.0f} {last['lends']:5.0f} {lend_s:>7s} "
            f"{reclaim_s:>9s}"
        )
    fastest = min(rows, key=lambda layout: rows[layout]["s_per_step"])
    print(f"fastest here: {fastest}")
    some = "" if len(args.layouts) == len(LAYOUTS) else "-" + "-".join(args.layouts)
    result = {
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": machine(loadavg_before=loadavg_before),
        "fastest": fastest,
        "layouts": rows,
    }
    path = write_results(f"layouts{some}.json", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
