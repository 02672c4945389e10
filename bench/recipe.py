"""Is a recipe reliable? Run one config ``--runs`` times, one after the other, and compare the
reward curves.

Each run is ``seamlessflow run <config>`` on its own embedded broker with its own run name and
output folder (the config's other settings as they are). Per run: steps, seconds, the mean
reward of the first and last ``--edge`` policy versions (10, as ``summary.json``) and the whole
curve, the sessions scored and how many spanned several policy versions (partial rollout),
and the same for tool calls per session when the run's agents count them (a tool task);
a run "rises" when its last mean reward exceeds its first by at least ``--rise``. Beside it, the
least-squares slope of the per-step mean reward (each step weighted by its sessions; per 100
steps) and its z, the slope over its standard error: per-step means are noisy (a step of few
samples holds the sessions that ended first, often the best), so a first/last gap alone can be
chance; z >= 2 is a trend. The curves
(reward; tool calls in a second panel) are drawn into one PNG next to the JSON. ``uptime``'s
load average is recorded at the start and end of each run (the machine may be shared).
``--games N`` (the ``guess`` env): the start policy and each run's final checkpoint play the
same N games apart from training (``bench.guess_play``), the change in expected reward without
the curve's noise and its bias per version; a run "rises" there when the end's mean reward is
at least 2 standard errors above the start's. ``--keep DIR`` keeps each run's output folder
(its broker store too) under ``DIR``, to read the runs' sessions afterwards (``seamlessflow
broker --state-dir DIR/<run>/broker``, then ``seamlessflow export``); by default they are
removed.

Usage: python -m bench.recipe [--config examples/smollm2.toml] [--runs 3] [--rise 0.1]
       python -m bench.recipe --config examples/tools.toml --config examples/tools_baseline.toml
       --runs 3 --runs 1   (several configs: one after the other, all in one table and PNG,
       written as recipe-<first config stem>.json)
Prints a table and writes bench/results/recipe-<config stem>.json and .png.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from bench.machine import machine
from bench.output import write_results
from seamlessflow.report import EDGE, mean_over


def run_once(config: Path, name: str, out: Path, edge: int = EDGE) -> dict:
    """One run of ``config`` named ``name`` writing to ``out``; its summary, with the first and
    last means over ``edge`` policy versions."""
    text = config.read_text()
    if "output_dir" in tomllib.loads(text):
        raise SystemExit(f"{config} sets output_dir: this bench gives each run its own")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / config.name
        copy.write_text(f'output_dir = "{out}"\n' + text)
        command = [sys.executable, "-m", "seamlessflow.cli", "run", str(copy), "--run", name]
        started = time.perf_counter()
        load_before = os.getloadavg()
        done = subprocess.run(command, capture_output=True, text=True)
        load_after = os.getloadavg()
    if done.returncode != 0:
        raise RuntimeError(f"run {name} exited with {done.returncode}:\n{done.stdout[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "run": name,
        "wall_s": time.perf_counter() - started,
        "steps": summary["steps"],
        "edge": edge,
        "sessions": summary["sessions"],
        "sessions_multi_version": summary["sessions_multi_version"],
        "reward_first": mean_over(summary["curve"][:edge]),
        "reward_last": mean_over(summary["curve"][-edge:]),
        "curve": summary["curve"],
        "tool_calls_first": mean_over(summary["tool_curve"][:edge]),
        "tool_calls_last": mean_over(summary["tool_curve"][-edge:]),
        "tool_curve": summary["tool_curve"],
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
    }


def played(config: Path, out: Path, games: int) -> dict:
    """The start policy and the run's last checkpoint, each playing ``games`` guess games."""
    from bench.guess_play import play, policy
    from trainer import checkpoint

    start, tokenizer, game = _guess_setting(config)
    last = checkpoint.latest_path(out / "checkpoints")
    return {
        "checkpoint_version": checkpoint.version_of(last),
        "start": _start_played(config, games),
        "end": play(policy(start, last), tokenizer, games, **game),
    }


@functools.cache
def _start_played(config: Path, games: int) -> dict:
    """The start policy's games: the same for every run of ``config`` (same secrets and seed)."""
    from bench.guess_play import play, policy

    start, tokenizer, game = _guess_setting(config)
    return play(policy(start), tokenizer, games, **game)


@functools.cache
def _guess_setting(config: Path) -> tuple[Path, object, dict]:
    """``config``'s start policy (the cached warm start its runs begin from), its tokenizer and
    the game's settings."""
    from common.models import load_tokenizer
    from seamlessflow.config import load_config
    from seamlessflow.warm_start import prepare_model

    cfg = load_config(config)
    if cfg.tasks.env != "guess":
        raise SystemExit(f"--games plays the guess env; {config} has env {cfg.tasks.env!r}")
    start = prepare_model(cfg)
    game = dict(
        high=cfg.tasks.max_number,
        max_turns=cfg.tasks.max_turns,
        max_tokens=cfg.tasks.max_tokens,
        temperature=cfg.agents.temperature,
    )
    return start, load_tokenizer(start), game


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tools = any(r["tool_curve"] for r in rows)
    fig, axes = plt.subplots(1, 2 if tools else 1, figsize=(12 if tools else 7, 4), squeeze=False)
    for r in rows:
        versions = [version for version, _, _ in r["curve"]]
        axes[0][0].plot(
            versions, [reward for _, reward, _ in r["curve"]], marker=".", label=r["run"]
        )
        if tools:
            versions = [version for version, _, _ in r["tool_curve"]]
            calls = [c for _, c, _ in r["tool_curve"]]
            axes[0][1].plot(versions, calls, marker=".", label=r["run"])
    axes[0][0].set(xlabel="policy version", ylabel="mean reward", title=title)
    axes[0][0].legend()
    if tools:
        axes[0][1].set(xlabel="policy version", ylabel="tool calls per session (mean)")
        axes[0][1].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, action="append", help="repeatable")
    parser.add_argument("--runs", type=int, action="append", help="per --config (default 3)")
    parser.add_argument("--rise", type=float, default=0.1, help="last - first that counts")
    parser.add_argument(
        "--edge",
        type=int,
        default=EDGE,
        help="first and last means over this many policy versions (the summary's: 10; fewer "
        "for runs of few steps, where 10 and 10 overlap)",
    )
    parser.add_argument("--keep", type=Path, help="keep each run's output folder under this")
    parser.add_argument(
        "--games", type=int, default=0, help="guess env: games the start and each end play"
    )
    args = parser.parse_args()
    configs = args.config or [Path("examples/smollm2.toml")]
    runs = args.runs or [3]
    if len(runs) == 1:
        runs = runs * len(configs)
    if len(runs) != len(configs):
        raise SystemExit("give --runs once, or once per --config")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        for config, n in zip(configs, runs, strict=True):
            for i in range(n):
                name = f"{config.stem}-{i}-{int(time.time())}"
                print(f"{config} run {i + 1}/{n}: {name} ...", flush=True)
                rows.append(run_once(config, name, root / name, args.edge))
                if args.games:
                    rows[-1]["played"] = played(config, root / name, args.games)
                    print(f"  played: {rows[-1]['played']}", flush=True)
    print(
        f"\n{'run':>34}{'steps':>7}{'wall s':>8}{'first':>8}{'last':>8}{'rises':>7}"
        f"{'slope/100':>10}{'z':>6}"
        f"{'tools first':>13}{'tools last':>12}{'multi-version':>15}{'load':>16}"
    )
    for r in rows:
        r["rises"] = r["reward_last"] - r["reward_first"] >= args.rise
        r["slope_per_100"], r["z"] = trend(r["curve"])
        print(
            f"{r['run']:>34}{r['steps']:>7}{r['wall_s']:>8.0f}{r['reward_first']:>8.3f}"
            f"{r['reward_last']:>8.3f}{r['rises']!s:>7}{r['slope_per_100']:>10.3f}{r['z']:>6.1f}"
            f"{_fmt(r['tool_calls_first']):>13}"
            f"{_fmt(r['tool_calls_last']):>12}"
            f"{r['sessions_multi_version'] / max(r['sessions'], 1):>15.0%}"
            f"{r['load_before'][0]:>8.1f}{r['load_after'][0]:>8.1f}"
        )
    if args.games:
        print(f"\n{'run':>34}{'start':>8}{'end':>8}{'se':>7}{'z':>6}{'found':>13}{'in range':>13}")
        for r in rows:
            start, end = r["played"]["start"], r["played"]["end"]
            r["played"]["z"] = (end["reward"] - start["reward"]) / (
                start["reward_se"] ** 2 + end["reward_se"] ** 2
            ) ** 0.5
            print(
                f"{r['run']:>34}{start['reward']:>8.3f}{end['reward']:>8.3f}"
                f"{end['reward_se']:>7.3f}{r['played']['z']:>6.1f}"
                f"{start['found']:>6.2f} {end['found']:>6.2f}"
                f"{start['in_range']:>6.2f} {end['in_range']:>6.2f}"
            )
        print(
            f"{sum(r['played']['z'] >= 2 for r in rows)} of {len(rows)} ends play "
            f"{args.games} games 2 standard errors above the start"
        )
    print(
        f"{sum(r['rises'] for r in rows)} of {len(rows)} runs rise by >= {args.rise} "
        f"(first and last {args.edge} versions); {sum(r['z'] >= 2 for r in rows)} of "
        f"{len(rows)} have a slope 2 standard errors above 0"
    )
    result = {
        "machine": machine(),
        "config": [str(c) for c in configs],
        "runs": runs,
        "rise": args.rise,
        "rows": rows,
    }
    path = write_results(f"recipe-{configs[0].stem}.json", result)
    plot(
        rows,
        path.with_suffix(".png"),
        " + ".join(f"{c} x {n}" for c, n in zip(configs, runs, strict=True)),
    )
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


def trend(curve: list[list[float]]) -> tuple[float, float]:
    """The least-squares slope of a curve's mean reward per step (``[step, mean, samples]``
    rows), each step weighted by its samples, per 100 steps, and its z (slope / standard error;
    0 for fewer than 3 steps). Weighted, because a session counts for the newest version among
    its tokens: with episodes spanning versions, steps alternate between many sessions and a few
    quick (high-reward) ones, and unweighted those few swing the fit as much as the many."""
    if len(curve) < 3:
        return 0.0, 0.0
    w = [max(c[2], 1) for c in curve]
    total = sum(w)
    x0 = sum(wi * c[0] for wi, c in zip(w, curve, strict=True)) / total
    y0 = sum(wi * c[1] for wi, c in zip(w, curve, strict=True)) / total
    sxx = sum(wi * (c[0] - x0) ** 2 for wi, c in zip(w, curve, strict=True))
    slope = sum(wi * (c[0] - x0) * (c[1] - y0) for wi, c in zip(w, curve, strict=True)) / sxx
    residual = sum(
        wi * (c[1] - y0 - slope * (c[0] - x0)) ** 2 for wi, c in zip(w, curve, strict=True)
    )
    se = (residual / (len(curve) - 2) / sxx) ** 0.5
    return slope * 100, slope / se if se > 0 else 0.0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
