"""What a run's steps and calls cost, as ``seamlessflow plan`` fits the simulator to them: the
``costs`` section of a run's summary (``run_costs``), from its calls (``progress.RunStats``), its
config and the trainer's timing."""

import bisect
import math
import statistics
from collections import Counter
from typing import Any

from seamlessflow.config import RunConfig
from seamlessflow.exceptions import ConfigError
from seamlessflow.progress import RunStats
from tagsched.spec import Layout


def run_costs(config: RunConfig, stats: RunStats, trainer: dict[str, float]) -> dict[str, Any]:
    """The run's shape (layout, workers, batch, admission and staleness bounds, the trainer's
    order: staleness mode, overlap and order wait; the answer's token cap), its seconds per step
    after the first quarter of its steps (start-up left out), and its calls as the engines saw
    them: tokens per call (median and the standard deviation of their log), the mean gap between
    a session's calls (the environment's latency), the mean time from a task's admission to each
    of its sessions' first call (the scheduler's clock against the gateway's), and ``engine
    load`` (``engine_load``: resident calls per engine, seconds and tokens, over the latest
    ``progress.CALL_SPANS`` calls, leaving out what ``trainer``'s timing says the engines did
    not serve)."""
    spans = [(sid, start, end, n) for sid, start, end, n in stats.call_spans if end > start]
    lengths = [n for *_, n in spans if n > 0]
    logs = [math.log(n) for n in lengths]
    gaps, last_end, starts = [], {}, []
    for sid, start, end, _ in sorted(spans, key=lambda span: span[1]):
        if sid in last_end:
            gaps.append(max(0.0, start - last_end[sid]))
        elif sid in stats.admitted_at:  # the session's first call
            starts.append(max(0.0, start - stats.admitted_at[sid]))
        last_end[sid] = end
    return {
        "layout": str(config.layout.kind),
        "rollout workers": config.rollout.workers,
        "trainer workers": trainer_workers(config),
        "group size": config.tasks.group_size,
        "groups per step": config.trainer.groups_per_step,
        "steps ahead": config.scheduler.steps_ahead,
        "max staleness": config.trainer.max_staleness,
        "staleness mode": str(config.trainer.staleness_mode),
        "overlap": config.trainer.overlap,
        "order wait seconds": config.trainer.order_wait_s,
        "max tokens": config.tasks.max_tokens,
        "step seconds (steady)": steady_step_s(stats.versions_at),
        "calls per sample": stats.calls / stats.samples if stats.samples else None,
        "call tokens median": statistics.median(lengths) if lengths else None,
        "call tokens log sd": statistics.pstdev(logs) if logs else None,
        "environment latency seconds (mean)": statistics.fmean(gaps) if gaps else None,
        "admission to first call seconds (mean)": statistics.fmean(starts) if starts else None,
        "engine load": engine_load(
            [(start, end, n) for _, start, end, n in spans],
            config.rollout.workers + lent_engines(config),
            serving_windows(config, stats.versions_at, trainer),
        ),
    }


def trainer_workers(config: RunConfig) -> int:
    """The workers ``seamlessflow run`` trains on: colocated, ``[layout.train] count`` of its
    ``rollout.workers`` (all of them for ``rest``); multiplexed, the trainer workers it starts
    besides the rollout workers, as a disaggregated one does its trainer workers (``count``, one
    for ``rest``). ``ConfigError`` for a colocated count above its workers, which the scheduler
    would wait for until its placement timeout."""
    kind, count = config.layout.kind, config.layout.spec().train.count
    if kind is not Layout.COLOCATED:
        return max(1, count or 1)
    workers = max(1, config.rollout.workers)
    if count is not None and count > workers:
        raise ConfigError(
            f"[layout.train] count = {count}: seamlessflow run starts rollout.workers = "
            f"{workers} colocated workers, and only they can train"
        )
    return workers if count is None else max(1, count)


def lent_engines(config: RunConfig) -> int:
    """Engines that serve besides the rollout workers', outside the trainer's steps: a
    multiplexed run's trainer workers, lent while they wait for a batch."""
    return trainer_workers(config) if config.layout.kind is Layout.MULTIPLEXED else 0


def steady_step_s(versions_at: list[tuple[int, float]]) -> float | None:
    """Seconds per version between the first quarter's last announcement and the last one."""
    if len(versions_at) < 4:
        return None
    (v0, t0), (v1, t1) = versions_at[len(versions_at) // 4 - 1], versions_at[-1]
    return (t1 - t0) / (v1 - v0)


def serving_windows(
    config: RunConfig, versions_at: list[tuple[int, float]], trainer: dict[str, float]
) -> list[tuple[float, float, int]]:
    """``(start, end, engines serving)`` where fewer of the run's engines serve than its
    layout's usual (the rollout workers' and ``lent_engines``): per version announced at ``t``,
    its step before it (the trainer's mean step, and the in-step publish and checkpoint stall:
    a colocated trainer's workers and a multiplexed trainer's own engines do not serve), and
    the weight load after it (every engine paused: optimizer step -> all serving, less the
    publish and stall)."""
    step = trainer.get("step seconds (mean)")
    if step is None:
        return []
    in_step = trainer.get("weight publish seconds, in the step (mean)", 0.0)
    in_step += trainer.get("checkpoint stall seconds per step", 0.0)
    serving = trainer.get("optimizer step -> all workers serving, seconds (mean)", in_step)
    load = max(0.0, serving - in_step)
    workers = config.rollout.workers
    colocated = config.layout.kind is Layout.COLOCATED
    training = max(0, workers - trainer_workers(config)) if colocated else workers
    windows = []
    for _, t in versions_at:
        windows += [(t - in_step - step, t, training), (t, t + load, 0)]
    return windows


def engine_load(
    spans: list[tuple[float, float, int]],
    engines: int,
    windows: list[tuple[float, float, int]] = (),
) -> list[list[float]]:
    """``[calls in flight per serving engine, seconds, tokens]`` per level, from ``(started,
    finished, tokens)`` calls on ``engines`` engines, fewer in ``windows`` (``serving_windows``;
    none: no level, and no tokens). A call's tokens come at an even rate over its serving time."""
    stops = sorted((a, b) for a, b, n in windows if n == 0 and b > a)
    merged: list[list[float]] = []
    for a, b in stops:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts, before = [a for a, _ in merged], [0.0]
    for a, b in merged:
        before.append(before[-1] + b - a)

    def stopped(t: float) -> float:  # stopped seconds before t
        i = bisect.bisect_right(starts, t)
        return before[i - 1] + min(t, merged[i - 1][1]) - merged[i - 1][0] if i else 0.0

    events = []
    for start, end, n in spans:
        serving = end - start - (stopped(end) - stopped(start))
        if serving > 0:
            events += [(start, 1, 1, n / serving), (end, 1, -1, -n / serving)]
    for a, b, n in windows:
        events += [(a, 0, 1, n), (b, 0, -1, n)]
    events.sort()
    levels: dict[tuple[int, int], list[float]] = {}
    calls, rate, before_t, fewer = 0, 0.0, None, Counter()
    for t, kind, step, change in events:
        serving = min((n for n, c in fewer.items() if c), default=engines)
        if calls and serving and before_t is not None and t > before_t:
            level = levels.setdefault((calls, serving), [0.0, 0.0])
            level[0] += t - before_t
            level[1] += rate * (t - before_t)
        if kind:
            calls, rate = calls + step, rate + change
        else:
            fewer[change] += step
        before_t = t
    return sorted([round(k / n, 3), round(s, 4), round(x, 2)] for (k, n), (s, x) in levels.items())
