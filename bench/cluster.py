"""What crossing nodes costs: the same small run on one host and on the namespace cluster.

Both arms start the same parts, each a ``seamlessflow`` command with the same run config (the
quickstart's: the warm-started tiny model, hf engine, arithmetic tasks, disaggregated), in
namespace nodes of ``tests.nodes`` (own address, hostname, ``/dev/shm`` and state; joined by a
bridge); only where they run differs:

- ``one_host``: one node runs one NATS server (streams with 1 replica) and every part: the
  trajectory manager, scheduler, gateway, agent runner, trainer and two rollout workers, which
  load each version from the trainer's host-local copy (``path=local``);
- ``cluster``: 4 nodes; a 3-server NATS route cluster on the first three (streams with 3
  replicas, like tests/test_cluster.py), the trajectory manager, scheduler, gateway and agent
  runner on the first, a rollout worker on the second and third, the trainer on the fourth, so
  every version crosses nodes through the run's object store (``path=store``).

Per arm, with every part up, this process (on the bridge, one clock for all: the nodes share
this machine's):

1. gateway latency: ``--calls`` sequential greedy chat completions (an arithmetic question,
   ``max_tokens`` as the task's) to the gateway over HTTP, before any training (every worker
   idle and on the same starting weights in both arms); p50/p99 after ``WARMUP_CALLS``;
2. the run: tasks submitted, timed until the trainer's version ``--steps``. Seconds per step:
   between the first announcements of versions ``WARMUP_STEPS`` and ``--steps``. Weight sync
   per version and worker: from the trainer's first announcement of the version (its host-local
   copy written: the optimizer step is done) to the worker's registry entry saying it serves
   it (written right after its load); versions a worker skipped (superseded while it loaded)
   are counted apart. The workers' own ``weights_loaded`` log lines give each load's path and
   its fetch and total seconds; the trainer's ``/metrics`` its compute per step, its upload to
   the store and its own optimizer-step-to-all-serving (``trainer.watch``), as means.

Arms take turns for ``--rounds`` (noise on this shared machine falls on both alike); the table
gives the medians of per-round values (latency quantiles over all rounds' calls) and the ratio
cluster / one host. ``--rate`` caps every node's link (both directions, ``tc`` ``tbf``): a
slower network than the bridge's. (``netem`` delays would show a real network's latency, but
this machine's kernel has no ``sch_netem``.)

Usage (root): python -m bench.cluster [--steps 20] [--rounds 1] [--calls 100] [--rate 100mbit]
(about 5-7 min a round with --steps 30 on 2 shared cores). Prints a table and writes
bench/results/cluster.json (with --rate: cluster-<rate>.json).
"""

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tomli_w
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from bench.machine import machine
from bench.output import write_results
from broker import codec
from broker.client import session
from broker.messages import WeightsPublished
from broker.registry import watch_registry
from broker.server import find_nats_server
from broker.subjects import SESSION_HEADER, RunNames
from common.metrics import metric_sum, scrape
from emulation.sim.measure import quantile
from rollout.agents.arithmetic import arithmetic_tasks, question
from seamlessflow.config import RunConfig, load_config
from seamlessflow.report import trainer_report
from seamlessflow.submit import submit_tasks
from seamlessflow.warm_start import prepare_model
from tests.node_services import PY, Service, jetstream_ready, start_nats
from tests.nodes import Cluster, Node, available
from tests.support import eventually

RUN = "costs"
GATEWAY_PORT = 8000
TRAINER_METRICS_PORT = 9404
METRICS_ON_BRIDGE = {"SEAMLESSFLOW_METRICS_HOST": "0.0.0.0"}
"""The trainer's /metrics, which this process scrapes over the bridge."""
WARMUP_CALLS = 3
WARMUP_STEPS = 2
"""Versions before this one fill the pipeline: seconds per step count from it."""


@dataclass(frozen=True)
class Placement:
    """Which node (an index) runs what; ``front``: trajectory manager, scheduler, gateway and
    agent runner."""

    nodes: int
    nats: tuple[int, ...]
    front: int
    trainer: int
    workers: tuple[int, ...]


ARMS = {
    "one_host": Placement(nodes=1, nats=(0,), front=0, trainer=0, workers=(0, 0)),
    "cluster": Placement(nodes=4, nats=(0, 1, 2), front=0, trainer=3, workers=(1, 2)),
}


@dataclass
class VersionWatch:
    """When each version was first announced and when each worker's registry entry first said
    it serves it, on this process's ``time.monotonic()``."""

    announced: dict[int, float] = field(default_factory=dict)
    serving: dict[str, dict[int, float]] = field(default_factory=dict)
    registered: set[str] = field(default_factory=set)

    async def on_weights(self, msg: Msg) -> None:
        event = codec.decode(WeightsPublished, msg.data)
        self.announced.setdefault(event.version, time.monotonic())

    async def follow(self, js, names: RunNames) -> None:
        while True:
            try:
                async for sighting in watch_registry(js, names):
                    entry = sighting.entry
                    if entry is not None:
                        self.registered.add(sighting.worker_id)
                    if entry is not None and entry.version is not None:
                        versions = self.serving.setdefault(sighting.worker_id, {})
                        versions.setdefault(entry.version, sighting.written_at)
            except NatsError:
                await asyncio.sleep(0.5)

    def version(self) -> int:
        return max(self.announced, default=0)


def run_config(path: Path, model: Path, replicas: int) -> RunConfig:
    """The run config both arms use (``replicas``: the streams'), written to ``path``."""
    table = {
        "run": RUN,
        "model": {"name": str(model)},
        "provision": {"replicas": replicas},
        "trainer": {"worker_id": "trainer"},
    }
    path.write_text(tomli_w.dumps(table))
    return load_config(path)


def shape(cluster: Cluster, rate: str) -> None:
    """Cap each node's link at ``rate`` both ways: tbf on the bridge side of its veth (to the
    node) and on its eth0 (from it)."""
    tbf = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
    for node in cluster:
        subprocess.run(["tc", "qdisc", "add", "dev", node.cable, *tbf], check=True, timeout=10)
        node.exec(["tc", "qdisc", "add", "dev", "eth0", *tbf])


def start_parts(
    cluster: Cluster, where: Placement, url: str, config_path: Path
) -> dict[str, Service]:
    """Provision the run, then start every part where ``where`` puts it."""
    front, trainer = cluster[where.front], cluster[where.trainer]
    run_args = ("--nats", url, "--run", RUN, "--config", str(config_path))
    front.exec([PY, "-m", "seamlessflow.cli", "provision", *run_args], timeout=120)
    metrics = ("--metrics-port", str(TRAINER_METRICS_PORT))
    gateway = ("--host", "0.0.0.0", "--port", str(GATEWAY_PORT))
    parts = [
        Service(front, "trajectory", "trajectory", *run_args),
        Service(front, "scheduler", "scheduler", *run_args),
        Service(trainer, "trainer", "trainer", *run_args, *metrics, env=METRICS_ON_BRIDGE),
        *(_worker(cluster[n], f"rollout-{i}", run_args) for i, n in enumerate(where.workers)),
        Service(front, "gateway", "gateway", *run_args, *gateway),
        Service(front, "agents", "agents", *run_args, "--gateway", gateway_url(front)),
    ]
    return {part.name: part for part in parts}


def _worker(node: Node, worker_id: str, run_args: tuple[str, ...]) -> Service:
    tags = f"rollout,node={node.hostname}"
    worker = ("--worker-id", worker_id, "--role", "rollout", "--tags", tags)
    return Service(node, worker_id, "worker", *run_args, *worker)


def gateway_url(front: Node) -> str:
    return f"http://{front.address}:{GATEWAY_PORT}/v1"


def alive(parts: dict[str, Service], condition: Callable[[], Awaitable[bool]]):
    """``condition``, failing at once when a part has exited."""

    async def check() -> bool:
        for part in parts.values():
            if part.proc.poll() is not None:
                raise RuntimeError(f"{part.name} exited:\n{part.tail()}")
        return await condition()

    return check


async def gateway_latency(url: str, config: RunConfig, calls: int) -> dict:
    """Sequential greedy chat completions through the gateway: milliseconds each."""
    rng = random.Random(0)
    seconds, tokens = [], []
    async with httpx.AsyncClient(timeout=60.0) as http:
        for _ in range(calls + WARMUP_CALLS):
            a, b = (rng.randint(0, config.tasks.max_operand) for _ in range(2))
            body = {
                "model": config.model.served_name,
                "messages": [{"role": "user", "content": question(a, b)}],
                "max_tokens": config.tasks.max_tokens,
                "temperature": 0.0,
            }
            started = time.perf_counter()
            reply = await http.post(
                f"{url}/chat/completions", json=body, headers={SESSION_HEADER: uuid.uuid4().hex}
            )
            seconds.append(time.perf_counter() - started)
            reply.raise_for_status()
            tokens.append(reply.json()["usage"]["completion_tokens"])
    ms = [s * 1000 for s in seconds[WARMUP_CALLS:]]
    return {"ms": ms, "completion_tokens_mean": statistics.mean(tokens[WARMUP_CALLS:])}


async def submit(js, names: RunNames, config: RunConfig, n: int) -> None:
    tasks = arithmetic_tasks(
        random.Random(config.tasks.seed),
        n,
        max_operand=config.tasks.max_operand,
        group_size=config.tasks.group_size,
        max_turns=config.tasks.max_turns,
        max_tokens=config.tasks.max_tokens,
        prefix="costs",
    )
    await submit_tasks(js, names, tasks, progress=False)  # (every part is up: streams elected)


async def measure(
    cluster: Cluster, where: Placement, url: str, config: RunConfig, parts, args
) -> dict:
    names = RunNames(RUN)
    workers = [f"rollout-{i}" for i in range(len(where.workers))]
    watch = VersionWatch()
    async with session(url, "bench-cluster", give_up_after=120) as nc:
        js = nc.jetstream()
        await nc.subscribe(names.weights, cb=watch.on_weights)
        follow = asyncio.create_task(watch.follow(js, names))
        try:
            gateway = gateway_url(cluster[where.front])
            await eventually(
                alive(parts, lambda: _ready(watch, ["trainer", *workers])), timeout=300
            )
            await eventually(alive(parts, lambda: _answers(gateway)), timeout=120)
            latency = await gateway_latency(gateway, config, args.calls)
            await submit(js, names, config, 2 * args.steps * config.trainer.groups_per_step)
            started = time.monotonic()

            async def trained() -> bool:
                return watch.version() >= args.steps

            await eventually(alive(parts, trained), timeout=args.timeout)
            run_s = time.monotonic() - started
            await asyncio.sleep(1.0)  # the last version's loads
            trainer_url = f"http://{cluster[where.trainer].address}:{TRAINER_METRICS_PORT}/metrics"
            trainer_samples = await scrape(trainer_url)
        finally:
            follow.cancel()
    return summarize_arm(watch, workers, parts, latency, trainer_samples, run_s, args.steps)


async def _ready(watch: VersionWatch, workers: list[str]) -> bool:
    return watch.registered >= set(workers)


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(f"{url}/models")).status_code == 200
    except httpx.HTTPError:
        return False


def summarize_arm(
    watch: VersionWatch,
    workers: list[str],
    parts: dict[str, Service],
    latency: dict,
    trainer_samples,
    run_s: float,
    steps: int,
) -> dict:
    announced = watch.announced
    per_step = (announced[steps] - announced[WARMUP_STEPS]) / (steps - WARMUP_STEPS)
    sync, skipped = [], 0
    for worker in workers:
        serving = watch.serving.get(worker, {})
        for version in range(WARMUP_STEPS, steps + 1):
            if version in serving:
                sync.append(serving[version] - announced[version])
            else:
                skipped += 1
    loads = [load for w in workers for load in parts[w].weight_loads()]
    trainer = trainer_report(trainer_samples)
    store_count = metric_sum(
        trainer_samples, "sf_trainer_weight_publish_seconds_count", path="store"
    )
    store_sum = metric_sum(trainer_samples, "sf_trainer_weight_publish_seconds_sum", path="store")
    return {
        "run_s": round(run_s, 1),
        "s_per_step": per_step,
        "sync_s": sync,
        "sync_skipped": skipped,
        "load_paths": sorted({load.path for load in loads}),
        "loads": len(loads),
        "load_s_mean": statistics.mean(load.seconds for load in loads),
        "fetch_s_mean": statistics.mean(load.fetch_seconds for load in loads),
        "trainer_upload_s_mean": store_sum / store_count if store_count else None,
        "trainer_step_s_mean": trainer.get("step seconds (mean)"),
        "trainer_serving_s_mean": trainer.get(
            "optimizer step -> all workers serving, seconds (mean)"
        ),
        "samples_trained": trainer.get("samples trained", 0),
        "gateway_ms": latency["ms"],
        "completion_tokens_mean": latency["completion_tokens_mean"],
        "loadavg_after": os.getloadavg()[0],
    }


async def run_arm(arm: str, model: Path, folder: Path, args) -> dict:
    where = ARMS[arm]
    with Cluster(where.nodes) as cluster:
        if args.rate:
            shape(cluster, args.rate)
        servers = [cluster[i] for i in where.nats]
        url = start_nats(servers, find_nats_server())
        await jetstream_ready(url, servers)
        config_path = folder / "run.toml"
        config = run_config(config_path, model, replicas=len(servers))
        parts = start_parts(cluster, where, url, config_path)
        try:
            return await measure(cluster, where, url, config, parts, args)
        except BaseException:
            print("\n".join(part.tail() for part in parts.values()), flush=True)
            raise
        finally:
            parts["agents"].proc.send_signal(signal.SIGTERM)  # no new work while the rest stops


def table(results: dict[str, list[dict]]) -> tuple[list[tuple[str, ...]], dict]:
    """Rows (measure, one host, cluster, ratio) and the numbers behind them."""

    def med(arm: str, key: str) -> float | None:
        values = [r[key] for r in results[arm] if r[key] is not None]
        return statistics.median(values) if values else None

    def pooled(arm: str, key: str) -> list[float]:
        return [x for r in results[arm] for x in r[key]]

    summary = {}
    for arm in ARMS:
        sync, ms = pooled(arm, "sync_s"), pooled(arm, "gateway_ms")
        summary[arm] = {
            "s_per_step": med(arm, "s_per_step"),
            "trainer_step_s": med(arm, "trainer_step_s_mean"),
            "sync_p50_s": quantile(sync, 0.5),
            "sync_max_s": max(sync),
            "sync_skipped": sum(r["sync_skipped"] for r in results[arm]),
            "load_paths": sorted({p for r in results[arm] for p in r["load_paths"]}),
            "load_s": med(arm, "load_s_mean"),
            "fetch_s": med(arm, "fetch_s_mean"),
            "trainer_upload_s": med(arm, "trainer_upload_s_mean"),
            "trainer_serving_s": med(arm, "trainer_serving_s_mean"),
            "gateway_p50_ms": quantile(ms, 0.5),
            "gateway_p99_ms": quantile(ms, 0.99),
        }
    one, many = summary["one_host"], summary["cluster"]
    summary["ratio"] = {  # none to a base under a millisecond (the local path's "fetch")
        key: many[key] / one[key]
        for key, value in one.items()
        if isinstance(value, float) and value >= 1e-3 and many[key] is not None
    }

    def row(label: str, key: str, fmt: str) -> tuple[str, ...]:
        ratio = summary["ratio"].get(key)
        return (
            label,
            format(one[key], fmt),
            format(many[key], fmt),
            f"{ratio:.2f}x" if ratio else "-",
        )

    rows = [
        row("seconds per step", "s_per_step", ".2f"),
        row("  trainer compute per step, s (mean)", "trainer_step_s", ".3f"),
        row("weight sync: publish -> worker serving, p50 s", "sync_p50_s", ".3f"),
        row("  the same, max s", "sync_max_s", ".3f"),
        (
            "  path of the workers' loads",
            "/".join(one["load_paths"]),
            "/".join(many["load_paths"]),
            "-",
        ),
        row("  worker fetch + load, s (mean)", "load_s", ".3f"),
        row("    of which fetch, s (mean)", "fetch_s", ".3f"),
        row("  trainer upload to the store, s (mean)", "trainer_upload_s", ".3f"),
        row("  optimizer step -> all serving (trainer), s (mean)", "trainer_serving_s", ".3f"),
        row("gateway chat completion p50, ms", "gateway_p50_ms", ".1f"),
        row("gateway chat completion p99, ms", "gateway_p99_ms", ".1f"),
    ]
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="trainer versions per run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--calls", type=int, default=100, help="timed gateway calls per run")
    parser.add_argument("--rate", help="cap every node link (tc tbf rate, e.g. 100mbit)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run, at most")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed {WARMUP_STEPS}")
    if reason := available():
        raise SystemExit(f"bench.cluster: {reason}")
    loadavg_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="sf-bench-cluster-") as tmp:
        # the nodes do not see this machine's state folder, where the warm start is cached
        model = Path(shutil.copytree(prepare_model(RunConfig()), Path(tmp) / "model"))
        for round_ in range(args.rounds):
            for arm in ARMS:
                print(f"round {round_ + 1}/{args.rounds}: {arm} ...", flush=True)
                folder = Path(tmp) / f"{arm}-{round_}"
                folder.mkdir()
                results[arm].append(asyncio.run(run_arm(arm, model, folder, args)))
    rows, summary = table(results)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    header = ("measure", "one host", "cluster", "cluster / one host")
    widths = [max(w, len(h)) for w, h in zip(widths, header, strict=True)]
    for r in (header, *rows):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    result = {
        "steps": args.steps,
        "rounds": args.rounds,
        "calls": args.calls,
        "rate": args.rate,
        "placements": {arm: vars(where) for arm, where in ARMS.items()},
        "machine": machine(loadavg_before=loadavg_before, nats_server=str(find_nats_server())),
        "summary": summary,
        "runs": results,
    }
    path = write_results(f"cluster-{args.rate}.json" if args.rate else "cluster.json", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
