"""How well ``seamlessflow plan`` predicts the quickstart: planned from one layout's short run,
the simulator's seconds per step for each of the three layouts against what they measured.

Runs the quickstart in each layout (``bench.layouts.run_layout``: tiny model, hf engine, the
quickstart's settings, ``--steps`` trainer steps), fits the simulator to each run's
``summary.json`` (``emulation.fit.fit``) and predicts every layout at the quickstart's shape
(``emulation.plan.predictions``: the colocated layout on its worker, the others on a trainer
and a rollout worker). Seconds per step on both sides leave the first quarter of the steps out
(start-up: process start, the first batch). Prints, per run planned from, the fitted costs and
predicted / measured per layout (goal: within 15%), and writes bench/results/plan.json.

Usage: python -m bench.plan [--steps 60] [--sim-steps 40] [--out DIR]  (about 2 min per layout
on 2 cores; run it under ``flock /tmp/sf-bench.lock``).
"""

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from bench.layouts import LAYOUTS, run_layout
from bench.machine import machine
from bench.output import write_results
from emulation.fit import fit
from emulation.plan import predictions


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sim-steps", type=int, default=40)
    parser.add_argument(
        "--out",
        type=Path,
        help="the runs' folder (default: a new temporary one, kept); a "
        "layout whose summary.json is there already is not run again",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="sf-bench-plan-"))
    loadavg_before = os.getloadavg()[0]
    summaries, runs = {}, {}
    for layout in LAYOUTS:
        path = out / layout / "summary.json"
        if path.exists():
            print(f"{layout}: {path} (not run again)", flush=True)
        else:
            print(f"{layout} ...", flush=True)
            runs[layout] = run_layout(layout, args.steps, out)
        summaries[layout] = json.loads(path.read_text())
    measured = {layout: fit(s, layout).measured_s_per_step for layout, s in summaries.items()}
    planned = {}
    for source, summary in summaries.items():
        found = fit(summary, f"the {source} run")
        w = found.workload
        predicted = predictions(found, args.sim_steps)
        planned[source] = {
            "fitted": {
                "engine": dataclasses.asdict(w.engine),
                "trainer": dataclasses.asdict(w.trainer),
                "weight_sync_s": w.weight_sync_s,
                "switch_s": w.switch.warm_s,
                "lengths": dataclasses.asdict(w.lengths),
                "agent": dataclasses.asdict(w.agent),
                "assumed": list(found.assumed),
            },
            "layouts": {
                layout: {
                    "predicted_s_per_step": round(c.s_per_step, 3),
                    "measured_s_per_step": round(measured[layout], 3),
                    "ratio": round(c.s_per_step / measured[layout], 3),
                    "predicted_idle": round(c.idle, 3),
                }
                for layout, c in predicted.items()
            },
        }
    print(f"{'planned from':14s} {'layout':14s} {'predicted':>9s} {'measured':>8s} {'ratio':>6s}")
    for source, row in planned.items():
        for layout, p in row["layouts"].items():
            print(
                f"{source:14s} {layout:14s} {p['predicted_s_per_step']:9.3f} "
                f"{p['measured_s_per_step']:8.3f} {p['ratio']:6.3f}"
            )
        f = row["fitted"]
        print(
            f"  fitted: engine {f['engine']['a_s']:.4g} + {f['engine']['b_s']:.4g} * batch, "
            f"trainer {f['trainer']['a_s']:.4g} + {f['trainer']['s_per_token']:.4g} * tokens, "
            f"weight sync {f['weight_sync_s']:.3g} s, switch {f['switch_s']:.3g} s"
        )
    result = {
        "runs_folder": str(out),
        "steps": args.steps,
        "sim_steps": args.sim_steps,
        "machine": machine(loadavg_before=loadavg_before),
        "runs": runs,
        "planned_from": planned,
    }
    print(f"wrote {write_results('plan.json', result)}")


if __name__ == "__main__":
    main()
