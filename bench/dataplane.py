"""Data-plane micro-benchmarks, variants compared in one run as ratios.

1. codec: encode + validated decode per message, msgpack vs JSON, for a token chunk, a task and
   a 2k-token call record.
2. publish: tasks/s into JetStream, waiting for each PubAck in turn vs 64 in flight.
3. ingress: validated tasks/s through ``broker.ingress.Ingress`` (decode, handler, ack).

Usage: python -m bench.dataplane [--tasks 2000]
Prints a table and writes bench/results/dataplane.json.
"""

import argparse
import asyncio
import time

from bench.machine import machine
from bench.output import bench_broker, write_results
from broker import codec
from broker.client import session
from broker.config import ProvisionConfig
from broker.ingress import tasks_ingress
from broker.messages import CallRecorded, TaskSubmitted, TokensGenerated
from broker.provision import provision_run
from broker.subjects import Durable, RunNames
from seamlessflow.submit import submit_tasks


def _samples() -> dict[str, object]:
    n = 2048
    return {
        "TokensGenerated(16 tok)": TokensGenerated(
            call_id="c1",
            attempt=0,
            seq=3,
            worker_id="w1",
            version=7,
            token_ids=list(range(1000, 1016)),
            logprobs=[-0.25] * 16,
        ),
        "TaskSubmitted": _task(0),
        f"CallRecorded({n} tok)": CallRecorded(
            session_id="s1",
            call_id="c1",
            model="tiny",
            prompt_ids=list(range(512)),
            output_ids=list(range(n)),
            output_logprobs=[-1.5] * n,
            output_versions=[3] * n,
            finish_reason="stop",
            started_at=1.0,
            finished_at=2.0,
        ),
    }


def _task(i: int) -> TaskSubmitted:
    return TaskSubmitted(
        task_id=f"task-{i}",
        messages=[{"role": "user", "content": f"What is {i} + 17? Answer with the number."}],
        env="arith",
        reward={"reference": str(i + 17)},
        group_size=4,
    )


def bench_codec(min_time: float = 0.5) -> list[dict]:
    rows = []
    for name, msg in _samples().items():
        per = {}
        for enc in codec.Encoding:
            data = codec.encode(msg, enc)
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < min_time:
                for _ in range(50):
                    codec.decode(type(msg), codec.encode(msg, enc), content_type=enc.value)
                count += 50
            per[enc.name] = {"us_per_roundtrip": 1e6 * elapsed / count, "bytes": len(data)}
        rows.append(
            {
                "message": name,
                **{f"{k}_{m}": v for k, d in per.items() for m, v in d.items()},
                "json_over_msgpack_time": per["JSON"]["us_per_roundtrip"]
                / per["MSGPACK"]["us_per_roundtrip"],
            }
        )
    return rows


async def bench_dataplane(url: str, n: int) -> dict:
    async with session(url, "bench") as nc:
        return await _bench_dataplane(nc.jetstream(), n)


async def _bench_dataplane(js, n: int) -> dict:
    out = {}
    for window in (1, 64):
        names = RunNames(f"bench-w{window}")
        await provision_run(js, names.run)
        tasks = [_task(i) for i in range(n)]
        start = time.perf_counter()
        await submit_tasks(js, names, tasks, window=window, progress=False)
        out[f"publish_window_{window}_per_s"] = n / (time.perf_counter() - start)
    out["publish_window_64_over_1"] = out["publish_window_64_per_s"] / out["publish_window_1_per_s"]

    names = RunNames("bench-w64")
    seen = 0
    all_seen = asyncio.Event()

    async def handle(_task: TaskSubmitted, _d) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            all_seen.set()

    stop = asyncio.Event()
    limits = ProvisionConfig().tasks
    ingress = tasks_ingress(
        js, names, handle, limits, batch=256, fetch_timeout=0.5, durable=Durable.SCHEDULER
    )
    start = time.perf_counter()
    run = asyncio.create_task(ingress.run(stop))
    await all_seen.wait()
    out["ingress_validated_per_s"] = n / (time.perf_counter() - start)
    stop.set()
    await run
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=2000)
    args = parser.parse_args()
    codec_rows = bench_codec()
    with bench_broker() as broker:
        plane = asyncio.run(bench_dataplane(broker.url, args.tasks))
        server = ".".join(map(str, broker.version))

    print(
        f"{'message':<24}{'msgpack us':>12}{'json us':>10}{'json/msgpack':>14}"
        f"{'msgpack B':>11}{'json B':>9}"
    )
    for r in codec_rows:
        print(
            f"{r['message']:<24}{r['MSGPACK_us_per_roundtrip']:>12.1f}"
            f"{r['JSON_us_per_roundtrip']:>10.1f}{r['json_over_msgpack_time']:>14.2f}"
            f"{r['MSGPACK_bytes']:>11}{r['JSON_bytes']:>9}"
        )
    print()
    for key, value in plane.items():
        print(f"{key:<32}{value:>12.1f}")
    result = {
        "machine": machine(nats_server=server),
        "tasks": args.tasks,
        "codec": codec_rows,
        "dataplane": plane,
    }
    path = write_results("dataplane.json", result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
