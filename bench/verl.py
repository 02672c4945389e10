"""verl's published fully-async gains against the simulator with verl's own rhythm.

verl's fully-async trainer (docs/advance/fully_async.md, "128-card 7B Asynchronous Mode
Experiment": Qwen2.5-Math-7B, DAPO, 28K max response, rollout.n 16, 128 H20) reports, for 400
steps of 512 prompts: colocate sync 1d16h48m (a step 356.30 s: gen 177.85, old_log_prob
53.92, update_actor 113.81); the stream off-policy pipeline (64:64 GPUs,
``trigger_parameter_sync_step`` 4, ``require_batches`` 4 of 32 prompts) 1d1h53m, **1.58x**
(update_actor 98.77 s a step); with ``staleness_threshold`` 0.5 and partial rollout 17h22m,
**2.35x** (update_actor 113.16 s a step).

Modelled (``emulation.sim`` with ``emulation.sim.Rhythm``): sync colocated on 128 devices, a
step of 512 groups of 16; the two fully-async modes on 64 trainer and 64 rollout devices, a
trainer step of 128 groups (4 x 32 prompts), weights sent to the rollout engines every 4 steps,
the rollouter's budget 512 groups (x 1.5 with staleness 0.5) between syncs, the disaggregated
arm (a sync waits for running generations) for the stream pipeline and the partial-rollout arm
(a sync pauses them; they continue) for the last; stale samples trained (``downweight``), in
completion order. Each mode's trainer cost is its own published column (the sync step's
old_log_prob + update_actor on 128 devices; fully async computes no old log-probs and its
update_actor on 64 devices took less time than the sync one on 128, which no cost linear in
devices gives); the engine's fixed iteration cost is set so that the synchronous step takes
verl's 356.30 s. What verl does not publish, the response lengths, is swept: lognormal medians
and caps (``LENGTHS``), sigma 0.99. Gains are ratios of the time to the same samples (400
verl steps = 1600 trainer steps of 128 groups; simulated: ``--windows`` windows).

Usage: python -m bench.verl [--windows 6]  (about a minute). Prints a table and writes
bench/results/verl.json.
"""

import argparse
import random
import statistics
from functools import lru_cache

from bench.machine import machine
from bench.output import write_results
from common.staleness import StalenessMode
from emulation.sim import Order, Rhythm, simulate
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    SwitchCost,
    TrainerCost,
    Workload,
)

SYNC_STEP_S = 356.30
SYNC_TRAIN_S = 53.92 + 113.81  # old_log_prob + update_actor, a step of 512 prompts on 128
PUBLISHED = {"stream": 1.58, "partial": 2.35}
MODES = {
    # name: (arm, rhythm, update_actor seconds a window of 4 steps on 64 devices)
    "stream": ("disaggregated", Rhythm(sync_every=4, staleness=0.0), 98.77),
    "partial": ("partial_rollout", Rhythm(sync_every=4, staleness=0.5), 113.16),
}
LENGTHS = [(median, cap) for median in (1536, 2048, 3000) for cap in (20_000, 28_672)]
"""Response length models (median, cap): verl publishes neither."""
DEVICES, TRAINER_DEVICES, GROUP = 128, 64, 16
SYNC_GROUPS, ASYNC_GROUPS, SYNC_EVERY = 512, 128, 4
STEP_FIXED_S = 2.0
B_S = 1e-4  # the engine's per-sequence iteration cost; its fixed part is fitted


def workload(lengths: LengthModel, a_s: float, groups: int, train_s: float, devices: int):
    """The verl setting: ``groups`` groups of 16 a trainer step that takes ``train_s`` on
    ``devices`` devices at the lengths' mean."""
    tokens = groups * GROUP * mean_length(lengths)
    return Workload(
        lengths=lengths,
        engine=EngineCost(a_s=a_s, b_s=B_S, prefill_s_per_token=2e-6, max_batch=64),
        trainer=TrainerCost(
            a_s=STEP_FIXED_S, s_per_token=(train_s - STEP_FIXED_S) * devices / tokens
        ),
        agent=AgentModel(turns=1),
        switch=SwitchCost(warm_s=5.0, cold_s=30.0),
        weight_sync_s=5.0,
        group_size=GROUP,
        groups_per_step=groups,
    )


@lru_cache
def mean_length(lengths: LengthModel) -> float:
    """The mean of the capped lengths, from 2000 groups (once per length model: every
    workload of the bisection asks)."""
    rng = random.Random(0)
    return statistics.fmean(n for _ in range(2000) for n in lengths.sample_group(rng, GROUP))


def sync_step_s(lengths: LengthModel, a_s: float, steps: int) -> float:
    w = workload(lengths, a_s, SYNC_GROUPS, SYNC_TRAIN_S, DEVICES)
    return simulate(w, "sync_colocated", DEVICES, steps, 0).time_s / steps


def fit_a_s(lengths: LengthModel, steps: int) -> float:
    """The engine's fixed iteration cost at which the synchronous step takes verl's."""
    low, high = 1e-4, 0.05
    for _ in range(24):
        mid = (low + high) / 2
        low, high = (mid, high) if sync_step_s(lengths, mid, steps) < SYNC_STEP_S else (low, mid)
    return (low + high) / 2


def point(median: float, cap: int, windows: int) -> dict:
    lengths = LengthModel(median=median, sigma=0.99, cap=cap, group_corr=0.5)
    a_s = fit_a_s(lengths, windows)
    sync_s = sync_step_s(lengths, a_s, windows)
    row = {"median": median, "cap": cap, "engine_a_s": a_s, "sync_s_per_step": sync_s}
    for mode, (arm, rhythm, update_s) in MODES.items():
        w = workload(lengths, a_s, ASYNC_GROUPS, update_s / SYNC_EVERY, TRAINER_DEVICES)
        r = simulate(
            w,
            arm,
            DEVICES,
            SYNC_EVERY * windows,
            2 * SYNC_EVERY,  # above any lag the rhythm allows: nothing is dropped
            TRAINER_DEVICES,
            stale=StalenessMode.DOWNWEIGHT,
            order=Order.COMPLETION,
            rhythm=rhythm,
        )
        window_s = r.time_s / windows
        row[mode] = {
            "s_per_window": window_s,
            "gain": sync_s / window_s,
            "vs_published": sync_s / window_s / PUBLISHED[mode],
            "idle": r.idle,
            "staleness_mean": r.staleness_mean,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", type=int, default=6, help="verl steps simulated")
    args = parser.parse_args()
    rows = [point(median, cap, args.windows) for median, cap in LENGTHS]
    print(
        f"verl published: stream off-policy {PUBLISHED['stream']}x, partial {PUBLISHED['partial']}x"
    )
    print(
        f"{'median':>7}{'cap':>7}{'engine a':>10}{'sync s':>8}{'stream s':>9}{'gain':>7}"
        f"{'vs verl':>8}{'partial s':>10}{'gain':>7}{'vs verl':>8}"
    )
    for row in rows:
        s, p = row["stream"], row["partial"]
        print(
            f"{row['median']:>7g}{row['cap']:>7}{row['engine_a_s']:>10.4f}"
            f"{row['sync_s_per_step']:>8.1f}{s['s_per_window']:>9.1f}{s['gain']:>6.2f}x"
            f"{s['vs_published']:>8.2f}{p['s_per_window']:>10.1f}{p['gain']:>6.2f}x"
            f"{p['vs_published']:>8.2f}"
        )
    within = {
        mode: sum(abs(row[mode]["vs_published"] - 1) <= 0.15 for row in rows) for mode in MODES
    }
    print(f"within 15% of verl's: stream {within['stream']}/{len(rows)}, ", end="")
    print(f"partial {within['partial']}/{len(rows)}")
    path = write_results(
        "verl.json",
        {
            "machine": machine(),
            "published": PUBLISHED,
            "windows": args.windows,
            "rows": rows,
            "within_15": within,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
