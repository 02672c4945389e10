"""What a run's sessions reported besides the reward: the mean of each ``SessionEnded`` metric
(``found``, ``in_range`` and ``turns`` for the guess env) over the first and the last ``--edge``
policy versions, as ``summary.json`` gives the reward.

A session counts for the newest version among its generated tokens (the reward curve's), and a
mean is per session over those versions (``seamlessflow.report.mean_over``). Reads the folder
``seamlessflow export`` wrote (``sessions.parquet`` and ``samples.parquet``); for a run whose
broker is gone, serve its store first: ``seamlessflow broker --state-dir <output>/broker``
(``python -m bench.recipe --keep DIR`` keeps every run's).

Usage: python -m bench.session_metrics EXPORT_DIR [EXPORT_DIR ...] [--edge 10]
"""

import argparse
from pathlib import Path

from seamlessflow.report import EDGE


def by_version(folder: Path) -> dict[int, list[dict[str, float]]]:
    """Each version's sessions: their reward and metrics."""
    import pyarrow.parquet as pq

    versions: dict[str, int] = {}
    for sample in pq.read_table(folder / "samples.parquet").to_pylist():
        generated = [v for v, m in zip(sample["versions"], sample["loss_mask"], strict=True) if m]
        versions.setdefault(sample["session_id"], max(generated, default=0))
    out: dict[int, list[dict[str, float]]] = {}
    for session in pq.read_table(folder / "sessions.parquet").to_pylist():
        version = versions.get(session["session_id"])
        if session["ended"] and version is not None:
            row = {"reward": session["reward"], **dict(session["metrics"])}
            out.setdefault(version, []).append(row)
    return out


def means(sessions: dict[int, list[dict[str, float]]], versions: list[int]) -> dict[str, float]:
    rows = [row for v in versions for row in sessions[v]]
    names = dict.fromkeys(name for row in rows for name in row)
    return {
        name: sum(row[name] for row in rows if name in row) / sum(name in row for row in rows)
        for name in names
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folders", type=Path, nargs="+", help="seamlessflow export output")
    parser.add_argument("--edge", type=int, default=EDGE)
    args = parser.parse_args()
    for folder in args.folders:
        sessions = by_version(folder)
        versions = sorted(sessions)
        for label, chosen in (("first", versions[: args.edge]), ("last", versions[-args.edge :])):
            stats = " ".join(f"{k} {v:.3f}" for k, v in means(sessions, chosen).items())
            count = sum(len(sessions[v]) for v in chosen)
            print(f"{folder.name} {label} {args.edge} versions ({count} sessions): {stats}")


if __name__ == "__main__":
    main()
