"""Is a recipe reliable? Run one config ``--runs`` times, one after the other, and compare the
reward curves.

Each run is ``seamlessflow run <config>`` on its own embedded broker with its own run name and
output folder (the config's other settings as they are). Per run: steps, seconds, the mean
reward of the first and last 10 policy versions (``summary.json``), the sessions scored and
how many spanned several policy versions (partial rollout), and the whole curve; a run
"rises" when its last mean exceeds its first by at least ``--rise``. The curves are drawn into
one PNG next to the JSON.

Usage: python -m bench.recipe [--config examples/smollm2.toml] [--runs 3] [--rise 0.1]
Prints a table and writes bench/results/recipe-<config stem>.json and .png.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from bench.machine import machine

RESULTS = Path(__file__).parent / "results"


def run_once(config: Path, name: str, out: Path) -> dict:
    """One run of ``config`` named ``name`` writing to ``out``; its summary."""
    text = config.read_text()
    if "output_dir" in tomllib.loads(text):
        raise SystemExit(f"{config} sets output_dir: this bench gives each run its own")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / config.name
        copy.write_text(f'output_dir = "{out}"\n' + text)
        command = [sys.executable, "-m", "seamlessflow.cli", "run", str(copy), "--run", name]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"run {name} exited with {done.returncode}:\n{done.stdout[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "run": name,
        "wall_s": time.perf_counter() - started,
        "steps": summary["steps"],
        "sessions": summary["sessions"],
        "sessions_multi_version": summary["sessions_multi_version"],
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "curve": summary["curve"],
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        versions = [version for version, _, _ in r["curve"]]
        ax.plot(versions, [reward for _, reward, _ in r["curve"]], marker=".", label=r["run"])
    ax.set(xlabel="policy version", ylabel="mean reward", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("examples/smollm2.toml"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rise", type=float, default=0.1, help="last - first that counts")
    args = parser.parse_args()
    stem = args.config.stem
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            name = f"{stem}-{i}-{int(time.time())}"
            print(f"run {i + 1}/{args.runs}: {name} ...", flush=True)
            rows.append(run_once(args.config, name, Path(tmp) / name))
    print(
        f"\n{'run':>28}{'steps':>7}{'wall s':>8}{'first':>8}{'last':>8}{'rises':>7}"
        f"{'sessions':>10}{'multi-version':>15}"
    )
    for r in rows:
        r["rises"] = r["reward_last"] - r["reward_first"] >= args.rise
        print(
            f"{r['run']:>28}{r['steps']:>7}{r['wall_s']:>8.0f}{r['reward_first']:>8.3f}"
            f"{r['reward_last']:>8.3f}{r['rises']!s:>7}{r['sessions']:>10}"
            f"{r['sessions_multi_version'] / max(r['sessions'], 1):>15.0%}"
        )
    print(f"{sum(r['rises'] for r in rows)} of {len(rows)} runs rise by >= {args.rise}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"recipe-{stem}.json"
    result = {"machine": machine(), "config": str(args.config), "rise": args.rise, "rows": rows}
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, path.with_suffix(".png"), f"{args.config} x {len(rows)}")
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
