"""Weight broadcast through the run's object store: publish (trainer) and fetch (worker) seconds
per blob size and chunk size, compared in one run as ratios.

Three readers, each checking the SHA-256:
- ``natspy``: nats-py's ``ObjectStore.get`` (an ordered push consumer), what workers used before;
- ``pull``: ``broker.weights.fetch_weights`` (batched pulls) on the caller's connection;
- ``apart``: ``broker.weights.fetch_weights_apart``, the same in a thread with its own
  connection and event loop (what rollout workers use).
A rollout worker fetches while its event loop also streams tokens, so every fetch is measured
twice: on an idle loop, and on a loop that a second task keeps busy in 2 ms slices (as an
engine's output handling does).

Usage: python bench/weights.py [--sizes-mb 10 100] [--rounds 3]
Prints a table and writes bench/results/weights.json.
"""

import argparse
import asyncio
import hashlib
import io
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from broker.client import session
from broker.config import EmbeddedBrokerConfig
from broker.messages import WeightsPublished
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from broker.weights import (
    DEFAULT_CHUNK_BYTES,
    OBJSTORE,
    fetch_weights,
    fetch_weights_apart,
    publish_weights,
)

RESULTS = Path(__file__).parent / "results"
KiB, MiB = 1024, 1024 * 1024
NATS_PY_DEFAULT = 128 * KiB
CHUNKS = sorted({NATS_PY_DEFAULT, DEFAULT_CHUNK_BYTES, 1 * MiB, 4 * MiB})
LOOPS = ("idle", "busy")

Reader = Callable[[WeightsPublished], Awaitable[bytes]]


async def _busy(stop: asyncio.Event) -> None:
    """Hold the event loop 2 ms at a time until ``stop``."""
    while not stop.is_set():
        time.sleep(0.002)  # noqa: ASYNC251 -- on purpose: it stands for an engine's work
        await asyncio.sleep(0)


async def natspy_fetch(js, event: WeightsPublished) -> bytes:
    """The blob through nats-py's ``ObjectStore.get``, checked as ``fetch_weights`` does."""
    bucket, name = event.location.removeprefix(f"{OBJSTORE}://").split("/", 1)
    buffer = io.BytesIO()
    await (await js.object_store(bucket)).get(name, writeinto=buffer)
    blob = buffer.getvalue()
    digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
    assert digest == event.sha256
    return blob


async def _fetch_seconds(reader: Reader, event: WeightsPublished, busy: bool) -> float:
    stop = asyncio.Event()
    hog = asyncio.create_task(_busy(stop)) if busy else None
    start = time.perf_counter()
    await reader(event)
    seconds = time.perf_counter() - start
    stop.set()
    if hog is not None:
        await hog
    return seconds


async def bench(url: str, sizes_mb: list[int], rounds: int) -> list[dict]:
    rows = []
    async with session(url, "bench") as nc:
        js = nc.jetstream()
        readers: dict[str, Reader] = {
            "natspy": lambda e: natspy_fetch(js, e),
            "pull": lambda e: fetch_weights(js, e),
            "apart": lambda e: fetch_weights_apart(url, e),
        }
        names = RunNames("bench-weights")
        await provision_run(js, names.run)
        version = 0
        for size_mb in sizes_mb:
            blob = os.urandom(size_mb * MiB)
            keys = ["publish"] + [f"{r}_{loop}" for r in readers for loop in LOOPS]
            times = {c: {k: [] for k in keys} for c in CHUNKS}
            for _ in range(rounds):  # interleaved, so drift on a shared machine hits all alike
                for chunk in CHUNKS:
                    version += 1
                    start = time.perf_counter()
                    event = await publish_weights(
                        js, names, version, blob, keep=1, chunk_bytes=chunk
                    )
                    times[chunk]["publish"].append(time.perf_counter() - start)
                    for name, reader in readers.items():
                        for loop in LOOPS:
                            seconds = await _fetch_seconds(reader, event, loop == "busy")
                            times[chunk][f"{name}_{loop}"].append(seconds)
            old = {k: statistics.median(v) for k, v in times[NATS_PY_DEFAULT].items()}
            for chunk in CHUNKS:
                med = {k: statistics.median(v) for k, v in times[chunk].items()}
                rows.append(
                    {
                        "size_mb": size_mb,
                        "chunk_kib": chunk // KiB,
                        **{f"{k}_s": v for k, v in med.items()},
                        "publish_speedup": old["publish"] / med["publish"],
                        # against what workers did before: nats-py get of 128 KiB chunks
                        **{
                            f"{r}_{loop}_speedup": old[f"natspy_{loop}"] / med[f"{r}_{loop}"]
                            for r in ("pull", "apart")
                            for loop in LOOPS
                        },
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as state,
        EmbeddedBroker(EmbeddedBrokerConfig(state_dir=Path(state))) as broker,
    ):
        rows = asyncio.run(bench(broker.url, args.sizes_mb, args.rounds))
        server = ".".join(map(str, broker.version))
    print("median seconds; speed-up: against nats-py get of 128 KiB chunks on the same loop")
    readers = ("natspy", "pull", "apart")
    columns = [("publish", "publish_s", ".3f")]
    columns += [(f"{r} {loop}", f"{r}_{loop}_s", ".3f") for r in readers for loop in LOOPS]
    columns += [("x publish", "publish_speedup", ".2f")]
    columns += [
        (f"x {r} {loop}", f"{r}_{loop}_speedup", ".2f") for r in readers[1:] for loop in LOOPS
    ]
    header = f"{'MB':>5}{'chunk KiB':>10}" + "".join(f"{c[0]:>13}" for c in columns)
    print(header)
    for r in rows:
        cells = "".join(f"{r[key]:>13{fmt}}" for _, key, fmt in columns)
        print(f"{r['size_mb']:>5}{r['chunk_kib']:>10}{cells}")
    RESULTS.mkdir(exist_ok=True)
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "nats_server": server,
            "loadavg": os.getloadavg()[0],
        },
        "rounds": args.rounds,
        "rows": rows,
    }
    path = RESULTS / "weights.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
