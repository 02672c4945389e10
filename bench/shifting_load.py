"""Multiplexing where the load moves (issue 22, item 2), in the cluster simulator.

Workloads whose rollout/train balance changes during a run:

- ``growing``: single-turn reasoning whose median response length grows 4x from the first step
  to the last (``LengthModel.growth_per_step``), on engines with a KV budget
  (``EngineCost.kv_tokens``): longer responses, smaller decode batches, so rollout's share of
  the work grows;
- ``growing_no_kv``: the same without the KV budget (a fixed batch limit): both sides' work is
  then linear in the same tokens, and the balance hardly moves (the control);
- ``phased``: single-turn reasoning and agentic (multi-turn, environment latency) tasks
  arriving in phases (``Workload.phases``).

For each, per seed: the multiplexed arm against (i) a static split tuned on the run's first 10%
(the split swept on a short run of the first 10% of the steps, the best one then run for the
whole run: what a user can do) and (ii) the best static split in hindsight (swept over the whole
run). The multiplexed arm's own split is tuned the way a user would, on the first 10%. Ratios
are of trained samples a second over N steps (multiplexed over static; in ``drop`` mode a step
trains fewer samples where some were stale, so time to N steps would favour the arm that drops
more), mean and min..max over seeds, at each switch cost. Runs are modelled time, not
wall-clock.

Diagnostics on seed 0, per window of 10% of the steps: the best static split (the balance
moving), the time of a split moved to each window's best for free (the bound of any mechanism
that only moves devices between roles), and the multiplexed arm's trainer idle, lent share and
lends.

Usage: nice -n 10 python -m bench.shifting_load [--seeds 3] [--steps 40] [--devices 32]
[--order completion|admission|overlap] [--order-wait-s 25] (about 5 minutes on one core). Prints
tables, writes bench/results/shifting_load.json (shifting_load-<order>-<wait>s.json for another
order).
"""

import argparse
import statistics
import time
from dataclasses import replace

from bench.machine import machine
from bench.output import write_results
from emulation.sim import Arm, Cluster, Order, split_candidates
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    Phase,
    SwitchCost,
    TrainerCost,
    Workload,
)

STALENESS = 2
WINDOWS = 10
"""Diagnostics cut a run into this many windows of steps (10%: the tuning window's size)."""


def base(*, switch_s: float = 5.0, seed: int = 0) -> Workload:
    """Engines with a KV budget of 16k tokens (about 32 sequences at the first step's lengths,
    8 at the last's; 64 at most), training a third of decoding's cost per token at a batch of
    32 (``bench.sim``'s ratio 3), 64 groups of 8 per step."""
    engine = EngineCost(
        a_s=0.02, b_s=0.0005, prefill_s_per_token=2e-5, max_batch=64, kv_tokens=16384
    )
    decode_per_token = engine.iteration_s(32) / 32
    return Workload(
        lengths=LengthModel(median=256, sigma=0.99, cap=8192, group_corr=0.5),
        engine=engine,
        trainer=TrainerCost(a_s=2.0, s_per_token=decode_per_token / 3),
        switch=SwitchCost(warm_s=switch_s, cold_s=6 * switch_s),
        weight_sync_s=2.0,
        group_size=8,
        groups_per_step=64,
        seed=seed,
    )


def growing(steps: int, *, switch_s: float = 5.0, seed: int = 0) -> Workload:
    """Single turn, the median response 256 tokens at the first step and 1024 at the last."""
    w = base(switch_s=switch_s, seed=seed)
    growth = 4 ** (1 / (steps - 1)) - 1
    return replace(w, lengths=replace(w.lengths, growth_per_step=growth))


def growing_no_kv(steps: int, *, switch_s: float = 5.0, seed: int = 0) -> Workload:
    """``growing`` on engines limited to 32 sequences whatever their lengths."""
    w = growing(steps, switch_s=switch_s, seed=seed)
    return replace(w, engine=replace(w.engine, max_batch=32, kv_tokens=0))


def phased(steps: int, *, switch_s: float = 5.0, seed: int = 0) -> Workload:
    """Four phases of a quarter of the run each: single-turn reasoning (median 1024 tokens),
    agentic (4 turns of median 64 tokens, 8 s of environment latency between them), single
    turn, agentic."""
    w = base(switch_s=switch_s, seed=seed)
    w = replace(w, lengths=replace(w.lengths, median=1024))
    agentic = Phase(
        agent=AgentModel(turns=4, env_latency_s=8.0), lengths=replace(w.lengths, median=64)
    )
    single = Phase(agent=w.agent, lengths=w.lengths)
    q = steps // 4
    return replace(
        w,
        phases=(
            replace(agentic, from_step=q),
            replace(single, from_step=2 * q),
            replace(agentic, from_step=3 * q),
        ),
    )


WORKLOADS = {"growing": growing, "growing_no_kv": growing_no_kv, "phased": phased}


# -- runs ----------------------------------------------------------------------------------------
def run(
    w: Workload, arm: str, devices: int, steps: int, k: int, order: dict, probe_s: float = 0.0
) -> dict:
    """One run of ``arm`` with ``k`` trainer devices and the trainer's ``order`` (``Cluster``'s
    ``order`` and ``order_wait_s``): its result, the step timeline and, with ``probe_s``, the
    lends so far and the devices lent, sampled every ``probe_s`` seconds."""
    c = Cluster(
        w, Arm(arm), devices=devices, trainer_devices=k, steps=steps, staleness=STALENESS, **order
    )
    samples: list[tuple[float, int, int]] = []

    def probe() -> None:
        samples.append((c.loop.now, c.m.lends, len(c.lent)))
        c.loop.after(probe_s, probe)

    if probe_s:
        c.loop.after(0.0, probe)
    r = c.run().to_dict()
    r["step_ends"] = list(c.m.step_ends)
    r["step_times"] = list(c.m.step_times)
    r["probe"] = samples
    return r


SUMMARY = (
    "time_s",
    "samples_per_s",
    "idle",
    "mean_batch",
    "aborted_token_fraction",
    "reprefill_token_fraction",
    "length_bias",
    "staleness_mean",
    "lends",
)
"""What the JSON keeps of each run of a sweep."""


def sweep(w: Workload, arm: str, devices: int, steps: int, order: dict) -> dict[int, dict]:
    """Every trainer split's run (``SUMMARY``)."""
    out = {}
    for k in split_candidates(devices):
        r = run(w, arm, devices, steps, k, order)
        out[k] = {key: r[key] for key in SUMMARY}
    return out


def best(runs: dict[int, dict]) -> int:
    """The split that trains the most samples a second."""
    return max(runs, key=lambda k: runs[k]["samples_per_s"])


def compare(
    name: str, devices: int, steps: int, seed: int, switches: list[float], order: dict
) -> dict:
    """One seed: the static sweeps (a short run of the first 10% of the steps, and the whole
    run), then per switch cost the multiplexed arm at the split its own short sweep picks."""
    w = WORKLOADS[name](steps, seed=seed)
    short = max(1, steps // WINDOWS)
    early = sweep(w, "partial_rollout", devices, short, order)
    whole = sweep(w, "partial_rollout", devices, steps, order)
    out = {
        "seed": seed,
        "static": {
            "early_split": best(early),
            "hindsight_split": best(whole),
            "early_s": whole[best(early)]["time_s"],
            "hindsight_s": whole[best(whole)]["time_s"],
            "early_samples_per_s": whole[best(early)]["samples_per_s"],
            "hindsight_samples_per_s": whole[best(whole)]["samples_per_s"],
            "sweeps": {"early": early, "whole": whole},
        },
        "multiplexed": {},
    }
    for switch_s in switches:
        ws = WORKLOADS[name](steps, seed=seed, switch_s=switch_s)
        mux_early = sweep(ws, "multiplexed", devices, short, order)
        r = run(ws, "multiplexed", devices, steps, best(mux_early), order)
        out["multiplexed"][str(switch_s)] = {
            "split": best(mux_early),
            "sweep_early": mux_early,
            "reclaims": r["reclaims"],
            **{key: r[key] for key in SUMMARY},
        }
    return out


def windows(r: dict, steps: int, k: int) -> list[dict]:
    """Per window of ``steps / WINDOWS`` steps: its duration, the trainer's idle share (the
    time between its steps), the lends in it and the share of the ``k`` trainer devices'
    time spent lent."""
    ends, times, probe = r["step_ends"], r["step_times"], r["probe"]
    size = max(1, steps // WINDOWS)
    out = []
    for lo in range(0, steps, size):
        hi = min(steps, lo + size)
        t0 = ends[lo - 1] if lo else 0.0
        span = ends[hi - 1] - t0
        inside = [p for p in probe if t0 <= p[0] <= ends[hi - 1]]
        before = [p[1] for p in probe if p[0] < t0]
        out.append(
            {
                "steps": [lo, hi],
                "time_s": span,
                "trainer_idle": 1 - sum(times[lo:hi]) / span,
                "lends": inside[-1][1] - (before[-1] if before else 0) if inside else 0,
                "lent_share": statistics.fmean(p[2] for p in inside) / k if inside else 0.0,
            }
        )
    return out


def diagnose(
    name: str, devices: int, steps: int, switch_s: float, mux_split: int, order: dict
) -> dict:
    """Seed 0: the static arm's window times per split (where the best split moves, and the
    sum of the best window times: a split moved for free at every window, the bound of any
    mechanism that only moves devices between roles), and the multiplexed arm per window."""
    w = WORKLOADS[name](steps, seed=0, switch_s=switch_s)
    per_split = {
        k: windows(run(w, "partial_rollout", devices, steps, k, order), steps, k)
        for k in split_candidates(devices)
    }
    n = len(per_split[mux_split])
    best_k = [min(per_split, key=lambda k: per_split[k][i]["time_s"]) for i in range(n)]
    mux = run(w, "multiplexed", devices, steps, mux_split, order, probe_s=2.0)
    return {
        "best_static_split_per_window": best_k,
        "oracle_moving_split_s": sum(per_split[k][i]["time_s"] for i, k in enumerate(best_k)),
        "static_windows": {str(k): v for k, v in per_split.items()},
        "multiplexed_split": mux_split,
        "switch_s": switch_s,
        "multiplexed_windows": windows(mux, steps, mux_split),
    }


# -- printing ------------------------------------------------------------------------------------
GOALS = {"early": 1.15, "hindsight": 1.05}


def gains(rows: list[dict], switch_s: str) -> dict:
    """Per static reference: the multiplexed arm's trained samples a second over its, mean and
    min..max over seeds."""
    out = {}
    for ref in GOALS:
        xs = [
            r["multiplexed"][switch_s]["samples_per_s"] / r["static"][f"{ref}_samples_per_s"]
            for r in rows
        ]
        out[ref] = {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs)}
    return out


def print_workload(name: str, p: dict) -> None:
    rows = p["seeds"]
    print(f"\n== {name}")
    print(
        f"{'switch s':>9}{'seed':>5}{'splits early/hind/mux':>23}{'early s':>9}{'hind s':>9}"
        f"{'mux s':>9}{'lends':>7}{'idle tr':>8}"
    )
    for switch_s, g in p["gains"].items():
        for r in rows:
            st, m = r["static"], r["multiplexed"][switch_s]
            splits = f"{st['early_split']}/{st['hindsight_split']}/{m['split']}"
            print(
                f"{switch_s:>9}{r['seed']:>5}{splits:>23}{st['early_s']:>9.0f}"
                f"{st['hindsight_s']:>9.0f}{m['time_s']:>9.0f}{m['lends']:>7}"
                f"{m['idle']['train']:>8.2f}"
            )
        for ref, goal in GOALS.items():
            x = g[ref]
            print(
                f"  switch {switch_s} s: multiplexed vs static {ref:<10}"
                f"{x['mean']:.2f}x ({x['min']:.2f}..{x['max']:.2f}), goal {goal:.2f}x"
            )
    print(
        f"  mean over seeds{'idle all':>12}{'idle ro':>9}{'batch':>7}{'aborted':>9}"
        f"{'reprefill':>11}{'bias':>6}"
    )
    arms = {
        "static early": [r["static"]["sweeps"]["whole"][r["static"]["early_split"]] for r in rows],
        "static hindsight": [
            r["static"]["sweeps"]["whole"][r["static"]["hindsight_split"]] for r in rows
        ],
        **{f"multiplexed {s} s": [r["multiplexed"][s] for r in rows] for s in p["gains"]},
    }
    for arm, rs in arms.items():
        m = {k: statistics.fmean(r[k] for r in rs) for k in SUMMARY[3:7]}
        idle = statistics.fmean(r["idle"]["all"] for r in rs)
        ro = statistics.fmean(r["idle"]["rollout"] for r in rs)
        print(
            f"  {arm:<19}{idle:>8.3f}{ro:>9.3f}{m['mean_batch']:>7.1f}"
            f"{m['aborted_token_fraction']:>9.3f}{m['reprefill_token_fraction']:>11.3f}"
            f"{m['length_bias']:>6.2f}"
        )
    d = p["diagnosis"]
    early = rows[0]["static"]["early_s"]
    print(f"  seed 0, windows of {p['window_steps']} steps:")
    print(f"    best static split per window: {d['best_static_split_per_window']}")
    oracle = d["oracle_moving_split_s"]
    print(
        f"    split moved to the best per window for free: {oracle:.0f} s "
        f"({early / oracle:.2f}x the early-tuned static split)"
    )
    mux = d["multiplexed_windows"]
    print(f"    multiplexed at {d['multiplexed_split']} ({d['switch_s']:g} s switch), per window:")
    for key, fmt in (("time_s", "{:.0f}"), ("trainer_idle", "{:.2f}"), ("lent_share", "{:.2f}")):
        print(f"      {key:<13}" + " ".join(f"{fmt.format(x[key]):>6}" for x in mux))
    print(f"      {'lends':<13}" + " ".join(f"{x['lends']:>6}" for x in mux))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--switch", type=float, nargs="+", default=[5.0, 0.5])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--order",
        type=Order,
        default=Order.COMPLETION,
        help="the trainer's order in every arm (emulation.sim.Order; overlap: no length bias)",
    )
    parser.add_argument("--order-wait-s", type=float, default=25.0, help="its wait bound")
    args = parser.parse_args()
    order = {"order": args.order, "order_wait_s": args.order_wait_s}
    started = time.perf_counter()
    results: dict = {
        "machine": machine(),
        "setting": {
            "devices": args.devices,
            "steps": args.steps,
            "staleness": STALENESS,
            "seeds": args.seeds,
            "switch_s": args.switch,
            "order": args.order.value,
            "order_wait_s": args.order_wait_s,
        },
        "workloads": {},
    }
    for name in args.workloads:
        rows = [
            compare(name, args.devices, args.steps, seed, args.switch, order)
            for seed in range(args.seeds)
        ]
        p = {
            "workload": WORKLOADS[name](args.steps).to_dict(),
            "window_steps": max(1, args.steps // WINDOWS),
            "seeds": rows,
            "gains": {str(s): gains(rows, str(s)) for s in args.switch},
            "diagnosis": diagnose(
                name,
                args.devices,
                args.steps,
                args.switch[0],
                rows[0]["multiplexed"][str(args.switch[0])]["split"],
                order,
            ),
        }
        results["workloads"][name] = p
        print_workload(name, p)
    results["wall_s"] = time.perf_counter() - started
    suffix = "" if args.order is Order.COMPLETION else f"-{args.order}-{args.order_wait_s:g}s"
    path = write_results(f"shifting_load{suffix}.json", results)
    print(f"\nwrote {path} in {results['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
