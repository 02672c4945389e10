"""What a lend and a reclaim cost on a real engine: a colocated worker (``seamlessflow worker``
tagged ``train,rollout``: its engine and its trainer in one process) switched ``--switches``
times between ``train`` (lent to the trainer: routing stopped, generations aborted, engine
paused warm) and ``rollout`` (reclaimed: engine resumed, serving again), as the tag scheduler
switches it: a ``RoleChangeRequested`` core request per switch, epochs rising.

Per switch, two times:

- **ack**: from the request sent to the worker's ``RoleChangeAcked`` (what the scheduler waits
  for: the switch, the registry write and the reply);
- **worker**: the worker's own ``sf_worker_role_switch_seconds`` (request received to working
  in the new role), read as the histogram's sum over its count per role.

``--load N`` keeps N chat sessions calling the gateway (``--max-tokens`` each) the whole time,
so a lend aborts generations in flight (the gateway continues them once the worker serves
again), as it does in a run. The worker runs with one torch thread, as every launcher gives it
(with torch's default, one per core, a step under others' load takes up to seconds, and a lend
waits for the step in flight). No weights change between switches: a reclaim after a real step also
loads the step's weights (``bench/weights.py`` measures that part).

``--step-tokens 2048,256`` measures one worker per step budget
(``worker.engine.max_num_batched_tokens``), one after the other in the same run: a lend waits for
the engine step in flight (hf: the forward in flight), and the budget bounds it. ``calls/s`` is
the load's completed calls over the run's wall time: what the budget costs in throughput.

``--mode engine`` measures the engine alone, in this process, per step budget: rounds of
``--load`` requests (random prompts of 40-90 tokens, as a lend's continuations re-read theirs,
``--max-tokens`` each), paused once at a random moment of every round after the first and
resumed at once. The pause is what a lend waits for; the round's seconds are the throughput.
Writes bench/results/switch-engine-<engine>-<model>.json.

Usage: python -m bench.switch [--mode worker|engine] [--engine hf|vllm] [--model tiny|smollm2]
[--switches 50] [--load 4] [--step-tokens N,M]. Prints a table and writes
bench/results/switch-<engine>-<model>[-steps].json.
"""

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from pathlib import Path

import openai

from bench.output import bench_broker, percentile, write_model_run
from broker import codec
from broker.client import session
from broker.config import ProvisionConfig
from broker.messages import Role, SamplingParams
from broker.provision import provision_run
from broker.subjects import SESSION_HEADER, RunNames
from broker.worker_messages import RoleChangeAcked, RoleChangeRequested
from common.metrics import metric_sum, scrape
from common.models import model_info, resolve_model
from rollout.engines import ENGINE_CONFIGS, EngineConfig, start_engine
from rollout.gateway import Gateway, GatewayConfig
from seamlessflow.processes import worker_process

RUN = "bench-switch"
WORKER = "bench-colocated"
SERVED = "bench"
DEADLINE_S = 30.0


async def keep_calling(
    client: openai.AsyncOpenAI, i: int, max_tokens: int, calls: list, failed: list
) -> None:
    """One session's chat calls, one after another, until cancelled. A call the gateway gives
    up on (interrupted by a lend at each of its attempts: a call longer than ``--hold-s``) is
    counted in ``failed`` and the session goes on, so the load lasts the whole run."""
    n = 0
    while True:
        n += 1
        started = time.perf_counter()
        try:
            await client.chat.completions.create(
                model=SERVED,
                messages=[{"role": "user", "content": f"Count from {n} to {n + 20}."}],
                max_tokens=max_tokens,
                extra_headers={SESSION_HEADER: f"load-{i}-{n}"},
            )
        except openai.APIStatusError as exc:
            failed.append(exc.status_code)
            continue
        calls.append(time.perf_counter() - started)


async def switch(nc, names: RunNames, role: Role, epoch: int) -> float:
    request = RoleChangeRequested(
        worker_id=WORKER,
        role=role,
        epoch=epoch,
        reason="bench",
        deadline_s=DEADLINE_S,
        expires_at=time.time() + DEADLINE_S,  # same host: the worker's clock is this one
    )
    started = time.perf_counter()
    reply = await nc.request(names.ctl_role(WORKER), codec.encode(request), timeout=DEADLINE_S)
    seconds = time.perf_counter() - started
    ack = codec.decode(RoleChangeAcked, reply.data)
    if not ack.ok:
        raise RuntimeError(f"switch to {role.value} (epoch {epoch}) refused: {ack.error}")
    return seconds


def worker_seconds(samples, role: str) -> tuple[float, float]:
    """The worker's histogram: (sum, count) for ``role``."""
    name = "sf_worker_role_switch_seconds"
    picked = [s for s in samples if s.labels.get("role") == role]
    return metric_sum(picked, f"{name}_sum"), metric_sum(picked, f"{name}_count")


async def measure(
    nats_url: str, model: Path, args: argparse.Namespace, step_tokens: int | None, run: str
) -> dict:
    names = RunNames(run)
    async with session(nats_url, "bench-provision") as nc:
        await provision_run(nc.jetstream(), run, ProvisionConfig())
    budget = () if step_tokens is None else ("--engine-max-num-batched-tokens", str(step_tokens))
    worker = worker_process(
        nats_url,
        run,
        model,
        WORKER,
        "--engine",
        args.engine,
        *budget,
        "--tags",
        "train,rollout",
        "--max-running",
        str(args.max_running),
    )  # one torch thread (OMP_NUM_THREADS=1), as `seamlessflow run` and the launchers give it
    await asyncio.to_thread(worker.wait_ready, 900)
    times: dict[str, list[float]] = {"train": [], "rollout": []}
    calls: list[float] = []
    failed: list[int] = []
    try:
        config = GatewayConfig(model=SERVED, model_path=model, run=run, port=0)
        async with Gateway(config, nats_url) as gateway, session(nats_url, "bench-sched") as nc:
            client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
            load = [
                asyncio.create_task(keep_calling(client, i, args.max_tokens, calls, failed))
                for i in range(args.load)
            ]
            before = await scrape(worker.metrics_url)
            started = time.perf_counter()
            epoch = 0
            for n in range(args.switches):
                await asyncio.sleep(args.hold_s)  # serving (and generating, with --load)
                for role in (Role.TRAIN, Role.ROLLOUT):
                    epoch += 1
                    times[role.value].append(await switch(nc, names, role, epoch))
                    if role is Role.TRAIN:
                        await asyncio.sleep(args.hold_s)  # lent
                print(
                    f"\rswitches {n + 1}/{args.switches}: lend {times['train'][-1] * 1e3:.1f} "
                    f"ms, reclaim {times['rollout'][-1] * 1e3:.1f} ms",
                    end="",
                    flush=True,
                )
            print()
            wall = time.perf_counter() - started
            after = await scrape(worker.metrics_url)
            for task in load:
                task.cancel()
            for task in load:
                with contextlib.suppress(asyncio.CancelledError, openai.APIError):
                    await task
    finally:
        await asyncio.to_thread(worker.stop)
    result = {
        "step_tokens": step_tokens,
        "calls_completed": len(calls),
        "calls_failed": len(failed),
        "calls_per_s": len(calls) / wall,
    }
    for role, label in (("train", "lend"), ("rollout", "reclaim")):
        ms = [t * 1e3 for t in times[role]]
        total, count = (
            a - b
            for a, b in zip(worker_seconds(after, role), worker_seconds(before, role), strict=True)
        )
        result[label] = {
            "switches": len(ms),
            "ack_ms_p50": statistics.median(ms),
            "ack_ms_p99": percentile(ms, 99),
            "ack_ms_max": max(ms),
            "worker_ms_mean": total / count * 1e3 if count else None,
            "ack_ms": ms,
        }
    return result


async def measure_engine(model: Path, args: argparse.Namespace, step_tokens: int | None) -> dict:
    """The engine alone: ``--switches`` rounds of ``--load`` requests, each round after the first
    paused once at a random moment and resumed at once."""
    options = {} if args.engine == "hf" else {"max_num_seqs": args.max_running}
    if step_tokens is not None:
        options["max_num_batched_tokens"] = step_tokens
    settings = ENGINE_CONFIGS[args.engine](**options)
    engine = await start_engine(EngineConfig(model=model, max_model_len=512, settings=settings))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    vocab = model_info(model)["vocab_size"]

    async def request(request_id: str) -> None:
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(40, 90))]
        async for _ in engine.generate(request_id, prompt, params):
            pass

    pauses: list[float] = []
    rounds: list[float] = []
    try:
        for n in range(args.switches + 1):
            started = time.perf_counter()
            running = [asyncio.create_task(request(f"{n}-{i}")) for i in range(args.load)]
            if n:  # the first round warms up
                await asyncio.sleep(rng.uniform(0.05, 1.0))
                paused = time.perf_counter()
                await engine.pause()
                pauses.append(time.perf_counter() - paused)
                await engine.resume()
            await asyncio.gather(*running)
            if n:
                rounds.append(time.perf_counter() - started)
            print(f"\rrounds {n}/{args.switches}", end="", flush=True)
        print()
    finally:
        await engine.close()
    ms = [t * 1e3 for t in pauses]
    return {
        "step_tokens": step_tokens,
        "pause_ms_p50": statistics.median(ms),
        "pause_ms_p99": percentile(ms, 99),
        "pause_ms_max": max(ms),
        "round_s_mean": statistics.mean(rounds),
        "pause_ms": ms,
        "round_s": rounds,
    }


def print_table(columns: dict[str, int], rows: list[tuple[str, ...]]) -> None:
    """A right-aligned table: each column's title and width, then the rows' cells."""
    print("".join(f"{title:>{width}}" for title, width in columns.items()))
    for row in rows:
        print("".join(f"{cell:>{w}}" for cell, w in zip(row, columns.values(), strict=True)))


def budget(measured: dict) -> str:
    return "default" if measured["step_tokens"] is None else str(measured["step_tokens"])


def print_engine(measured: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{args.engine} / {args.model} alone: {args.switches} rounds of {args.load} requests "
        f"({args.max_tokens} tokens each), one pause a round"
    )
    first = measured[0]["round_s_mean"]
    columns = {"step tokens": 12, "pause p50 ms": 14, "p99 ms": 9, "max ms": 9, "round s": 9}
    rows = [
        (
            budget(m),
            f"{m['pause_ms_p50']:.1f}",
            f"{m['pause_ms_p99']:.1f}",
            f"{m['pause_ms_max']:.1f}",
            f"{m['round_s_mean']:.2f}",
            f"{m['round_s_mean'] / first:.2f}x",
        )
        for m in measured
    ]
    print_table({**columns, "x first": 9}, rows)


def print_worker(measured: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{args.engine} / {args.model}: {args.switches} lends and reclaims, {args.load} chat "
        f"sessions generating {args.max_tokens} tokens a call"
    )
    first = measured[0]["calls_per_s"]
    columns = {"step tokens": 12, "switch": 8, "ack p50 ms": 12, "ack p99 ms": 12, "max ms": 9}
    columns |= {"worker mean ms": 16, "calls done": 11, "given up": 9, "calls/s": 9, "x first": 8}
    rows = [
        (
            budget(m),
            label,
            f"{m[label]['ack_ms_p50']:.1f}",
            f"{m[label]['ack_ms_p99']:.1f}",
            f"{m[label]['ack_ms_max']:.1f}",
            "-" if m[label]["worker_ms_mean"] is None else f"{m[label]['worker_ms_mean']:.1f}",
            str(m["calls_completed"]),
            str(m["calls_failed"]),
            f"{m['calls_per_s']:.2f}",
            f"{m['calls_per_s'] / first:.2f}x" if first else "-",
        )
        for m in measured
        for label in ("lend", "reclaim")
    ]
    print_table(columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("worker", "engine"), default="worker")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--switches", type=int, default=50, help="lend + reclaim pairs")
    parser.add_argument("--load", type=int, default=4, help="chat sessions calling meanwhile")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=16, help="the worker's max_running")
    parser.add_argument("--hold-s", type=float, default=1.0, help="in each role between switches")
    parser.add_argument(
        "--step-tokens",
        type=lambda text: [int(n) for n in text.split(",")],
        default=None,
        help="step budgets to compare, one worker each (default: the engine's default)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = resolve_model(args.model)
    loadavg_before = os.getloadavg()[0]
    variants = args.step_tokens or [None]
    if args.mode == "engine":
        measured = [asyncio.run(measure_engine(model, args, tokens)) for tokens in variants]
        print_engine(measured, args)
        name, result = f"switch-engine-{args.engine}-{args.model}.json", {"variants": measured}
    else:
        with bench_broker() as broker:
            measured = [
                asyncio.run(measure(broker.url, model, args, tokens, f"{RUN}-{i}"))
                for i, tokens in enumerate(variants)
            ]
        print_worker(measured, args)
        name = f"switch-{args.engine}-{args.model}{'-steps' if args.step_tokens else ''}.json"
        result = measured[0] if len(measured) == 1 else {"variants": measured}
    write_model_run(name, args, model, result, loadavg_before)


if __name__ == "__main__":
    main()
