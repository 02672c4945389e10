"""Weight sync, measured per path in one run, next to the machine's limits.

``--mode paths`` (default): one version of ``--sizes-mb`` of float32 tensors, through
- ``memcpy``: copying the tensors once (torch ``clone``), the physical limit;
- ``local``: the trainer writing the safetensors file into tmpfs (``trainer.publisher``), and a
  worker on the same host copying it into its parameters (what an engine's ``load_weights``
  does);
- ``store``: the trainer storing the blob in the run's object store (with its SHA-256), and a
  worker fetching and checking it (``broker.weights.fetch_weights_apart``);
- ``nats``: the same bytes as raw core-NATS messages of the store's chunk size to one
  subscriber, the transport's own limit.
Prints seconds and GB/s per path and writes bench/results/weights-paths.json.

``--mode readers``: object-store readers and chunk sizes (why ``fetch_weights`` pulls):
- ``natspy``: nats-py's ``ObjectStore.get`` (an ordered push consumer), what workers used before;
- ``pull``: ``broker.weights.fetch_weights`` (batched pulls) on the caller's connection;
- ``apart``: ``broker.weights.fetch_weights_apart``, the same in a thread with its own
  connection and event loop (what rollout workers use).
A rollout worker fetches while its event loop also streams tokens, so every fetch is measured
twice: on an idle loop, and on a loop that a second task keeps busy in 2 ms slices (as an
engine's output handling does). Writes bench/results/weights.json.

Usage: python -m bench.weights [--mode paths|readers] [--sizes-mb 100 540] [--rounds 3]
"""

import argparse
import asyncio
import hashlib
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.machine import machine
from bench.output import bench_broker, write_results
from broker.client import session
from broker.messages import WeightsPublished
from broker.provision import provision_run
from broker.subjects import RunNames
from broker.weights import (
    DEFAULT_CHUNK_BYTES,
    LOCAL_BLOB,
    OBJSTORE,
    fetch_weights,
    fetch_weights_apart,
    local_folder,
    publish_weights,
)
from trainer.config import TrainerConfig
from trainer.publisher import write_folder

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


def _tensors(size_mb: int) -> dict[str, torch.Tensor]:
    """About ``size_mb`` of float32 tensors shaped like a transformer's (576-wide, 30 layers)."""
    count = max(1, size_mb * MiB // (576 * 1536 * 4))
    return {f"layers.{i}.mlp.weight": torch.randn(1536, 576) for i in range(count)}


def _load_into(params: dict[str, torch.Tensor], path: Path) -> None:
    """What an engine's ``load_weights`` does: read the file, copy each tensor into its
    parameter."""
    for name, tensor in load_file(path).items():
        params[name].copy_(tensor)


async def _raw_nats_seconds(nc, blob: bytes) -> float:
    """``blob`` as core-NATS messages of the store's chunk size, until one subscriber has all."""
    chunks = [blob[i : i + DEFAULT_CHUNK_BYTES] for i in range(0, len(blob), DEFAULT_CHUNK_BYTES)]
    received, done = [0], asyncio.Event()

    async def count(msg) -> None:
        received[0] += len(msg.data)
        if received[0] == len(blob):
            done.set()

    sub = await nc.subscribe("bench.raw", cb=count, pending_bytes_limit=2 * len(blob))
    start = time.perf_counter()
    for chunk in chunks:
        await nc.publish("bench.raw", chunk)
    await nc.flush()
    await done.wait()
    seconds = time.perf_counter() - start
    await sub.unsubscribe()
    return seconds


async def paths(url: str, sizes_mb: list[int], rounds: int) -> list[dict]:
    rows = []
    async with session(url, "bench") as nc:
        js = nc.jetstream()
        names = RunNames("bench-paths")
        await provision_run(js, names.run)
        config = TrainerConfig(local_weights_dir=Path(tempfile.mkdtemp(dir="/dev/shm")))
        version = 0
        for size_mb in sizes_mb:
            state = _tensors(size_mb)
            times: dict[str, list[float]] = {}
            for _ in range(rounds):  # interleaved, so drift on a shared machine hits all alike
                version += 1
                start = time.perf_counter()
                [t.clone() for t in state.values()]
                times.setdefault("memcpy", []).append(time.perf_counter() - start)
                folder = local_folder(config.local_weights_dir, names, version)
                start = time.perf_counter()
                await asyncio.to_thread(write_folder, state, folder)
                wrote = time.perf_counter()
                await asyncio.to_thread(_load_into, state, folder / LOCAL_BLOB)
                times.setdefault("local_write", []).append(wrote - start)
                times.setdefault("local_read", []).append(time.perf_counter() - wrote)
                blob = (folder / LOCAL_BLOB).read_bytes()
                start = time.perf_counter()
                event = await publish_weights(js, names, version, blob, keep=1)
                stored = time.perf_counter()
                await fetch_weights_apart(url, event)
                times.setdefault("store_write", []).append(stored - start)
                times.setdefault("store_read", []).append(time.perf_counter() - stored)
                times.setdefault("nats", []).append(await _raw_nats_seconds(nc, blob))
                shutil.rmtree(folder)
            med = {k: statistics.median(v) for k, v in times.items()}
            gb = len(blob) / 1e9
            med["local"] = med["local_write"] + med["local_read"]
            med["store"] = med["store_write"] + med["store_read"]
            rows.append(
                {
                    "size_mb": round(len(blob) / MiB),
                    **{f"{k}_s": v for k, v in med.items()},
                    **{f"{k}_gbps": gb / med[k] for k in ("memcpy", "local", "store", "nats")},
                }
            )
        shutil.rmtree(config.local_weights_dir)
    return rows


def _print_paths(rows: list[dict]) -> None:
    print("median seconds per version (write + read); GB/s of the whole path")
    keys = ["memcpy", "local_write", "local_read", "store_write", "store_read", "nats"]
    print(f"{'MB':>5}" + "".join(f"{k:>13}" for k in keys) + "".join(
        f"{'GB/s ' + k:>14}" for k in ("memcpy", "local", "store", "nats")))  # fmt: skip
    for r in rows:
        cells = "".join(f"{r[f'{k}_s']:>13.3f}" for k in keys)
        rates = "".join(f"{r[f'{k}_gbps']:>14.2f}" for k in ("memcpy", "local", "store", "nats"))
        print(f"{r['size_mb']:>5}{cells}{rates}")


def _print_readers(rows: list[dict]) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("paths", "readers"), default="paths")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 540])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run, show, name = {
        "paths": (paths, _print_paths, "weights-paths.json"),
        "readers": (bench, _print_readers, "weights.json"),
    }[args.mode]
    with bench_broker() as broker:
        rows = asyncio.run(run(broker.url, args.sizes_mb, args.rounds))
        server = ".".join(map(str, broker.version))
    show(rows)
    result = {
        "machine": machine(nats_server=server),
        "rounds": args.rounds,
        "rows": rows,
    }
    path = write_results(name, result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
