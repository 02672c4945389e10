"""The arms of issue 12 on real processes: an emulated cluster, and the tiny model on 2 cores.

Each arm is one ``seamlessflow run`` (the real scheduler, trajectory manager, gateway, agent
runner and workers) on a nats-server this script starts, at equal devices, staleness bound and
trained samples per step. A *device* is one worker process (one engine; the trainer process or
the trainer's worker counts as one):

- ``sync_colocated``: every device generates, then every device trains. ``max_staleness 0`` and
  ``steps_ahead 1``: a step's groups are admitted only once the previous batch is trained, so
  rollout and training alternate; the emulated trainer models all ``D`` devices training. It
  runs in the multiplexed layout (the trainer's worker generates until the batch is ready;
  the rollout workers then wait as if they trained), not the colocated one, so that its
  results compare with earlier ones (the colocated layout with several workers stalled until
  the trainer group, ``trainer.group``, in which only rank 0 takes samples).
- ``partial_rollout``: layout disaggregated, a trainer process and ``D - 1`` rollout workers,
  asynchronous within the staleness bound (``steps_ahead = max_staleness + 1``), with partial
  rollout: a worker pauses at a token boundary for a weight update and continues on the new
  weights, and an interrupted attempt is continued elsewhere with its tokens. That is the only
  way the workers work: the simulator's ``disaggregated`` arm (a wave drains its generations
  before it loads) has no knob here, so it is not run.
- ``multiplexed``: the same with the trainer a worker tagged train and rollout, lent to rollout
  while it waits for a batch and reclaimed when the batch is ready.

The trainer is one device in the asynchronous arms: a trainer worker lent to rollout is one
engine, so a trainer of ``k`` devices would be lent as one device's capacity.

``--cluster emulated`` (default ``--devices 16``): the emulated engine and trainer backend
(``emulation.engine``, ``emulation.backend``, benchmarks only) spend the time of
``WORKLOAD`` (``emulation.workload``); the agent is ``emulated_agent`` below (``agent.turns`` calls,
an environment latency between them, each call seeded with its group and member so the engine
draws the group's lengths). ``--cluster tiny``: the tiny model on the hf engine and the torch
trainer, 2 devices on this machine's 2 cores (``[cpus]`` split: the trainer's process or worker
pinned to one core, the rollout worker to the other), the same agent on the arithmetic task
(warm-started model) with ``TINY_AGENT``'s turns and environment latency.

Per arm: seconds per step over ``--steps`` steps after ``--warmup`` (timed by weight-version
arrivals on the broker), trained samples/s, trained (loss) tokens/s, the idle fraction of every
worker (``sf_worker_role_seconds``, idle over all, between the end of the warm-up and the last
scrape), lends and reclaims with the reclaim latency p50/p99 (``sf_scheduler_reclaim_seconds``
buckets, interpolated), what the data plane added to each call (``plane_ms_per_call``: the
gateway's ``sf_gateway_overhead_seconds``, mean after the warm-up), and, for the emulated
cluster, the simulator's prediction at the same workload and the ratio measured/simulated
(``emulation.sim``, when it is importable).

``--orders`` runs each arm once per trainer order (``ORDERS``, issue 22 item 1): ``completion``
(no order wait: steps take the oldest complete groups, long ones overtaken), ``admission`` (the
defaults: a step waits, bounded, for an earlier admitted task it would put past the bound) and
``overlap`` (``trainer.overlap``: the step computed ahead while it waits, wait bound
``--overlap-wait``, 25 s by default; another bound writes ``pipeline[-drop]-wait<S>.json``). Each
row then also gives the trained samples' mean length over that of every sample the trainer
consumed (``length bias``) and the share of consumed loss tokens dropped (``thrown away``).

Usage: flock /tmp/sf-bench.lock python -m bench.pipeline [--cluster emulated|tiny]
[--arms a,b] [--devices 16] [--steps 8] [--stale drop] [--orders admission,overlap]
[--overlap-wait 25].
Prints a table, writes
bench/results/pipeline.json (one entry per cluster, updated in place), or with ``--stale drop``
bench/results/pipeline-drop.json: each arm's ``stale_dropped`` is what admission let past the
staleness bound.
"""

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.machine import CpuShare, machine
from bench.output import RESULTS, write_results
from emulation.workload import Workload
from trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parent.parent
WORKLOAD_ENV = "SF_BENCH_WORKLOAD"
"""The agent's workload (JSON), passed to the agent runner through its environment."""
SCRAPE_S = 2.0
MEAN_GAUGES = {
    "sf_rollout_requests_running": "running",  # a worker's attempts in progress
    "sf_rollout_requests_waiting": "waiting",  # ... its engine has not started
    "sf_scheduler_admission_outstanding": "outstanding",  # groups admitted, not yet acked
}
"""Gauges the row reports as their mean over the scrapes after the warm-up, by row key."""

WORKLOAD = Workload.from_dict(
    {
        "lengths": {"median": 48, "sigma": 0.99, "cap": 512, "group_corr": 0.5},
        "engine": {"a_s": 0.02, "b_s": 0.002, "prefill_s_per_token": 2e-5, "max_batch": 64},
        "trainer": {"a_s": 2.0, "s_per_token": 2e-4},
        "agent": {"turns": 2, "env_latency_s": 1.0},
        "switch": {"warm_s": 0.1, "cold_s": 0.1},
        "weight_sync_s": 0.5,
        "group_size": 8,
        "groups_per_step": 8,
    }
)
"""The emulated cluster's workload: long-tailed agentic (p99/median 10, cap 512, 2 turns with
1 s of environment between them). The switch cost is what a warm switch of a real worker
takes here (pause or resume the engine, tens of ms to 0.1 s), not a GPU's 5 s."""
TINY_AGENT = {"turns": 2, "env_latency_s": 0.5}
"""The tiny model's agent: up to 2 turns on the arithmetic task, 0.5 s of environment between."""


class ArmFailedError(Exception):
    """An arm's run failed or did not reach its steps."""


@dataclass(frozen=True)
class Arm:
    name: str
    layout: str
    synchronous: bool


ORDERS = {
    "completion": {"order_wait_s": 0},
    "admission": {},
    "overlap": {"overlap": True},
}
"""Trainer settings per order (``--orders``); ``admission`` is the defaults, ``overlap`` adds
``order_wait_s`` from ``--overlap-wait``."""
OVERLAP_WAIT_S = 25.0
"""The overlap order's wait bound by default: the simulator's main scenario's (item 1)."""


def order_settings(args: argparse.Namespace) -> dict:
    """The trainer settings of ``args.order``."""
    settings = dict(ORDERS[args.order])
    if args.order == "overlap":
        settings["order_wait_s"] = args.overlap_wait
    return settings


ARMS = {
    arm.name: arm
    for arm in (
        Arm("sync_colocated", "multiplexed", True),
        Arm("partial_rollout", "disaggregated", False),
        Arm("multiplexed", "multiplexed", False),
    )
}


# -- the agent (runs in the agent runner) -------------------------------------------------------


async def emulated_agent(ctx):
    """``agent.turns`` chat calls with an environment latency between them; stops early when the
    verifier accepts a reply (the tiny model's arithmetic). Each call's seed is ``group *
    group_size + member`` with the group ``Workload.draw_seed`` of the task's number and the
    turn: the emulated engine draws the lengths the simulator draws for that group (the
    scheduler admits tasks in the feed's order), and the hf engine samples each member
    differently."""
    from rollout.agents.agents import AgentResult, complete, max_tokens_of, openai_messages
    from seamlessflow.feed import task_number

    workload = Workload.from_dict(json.loads(os.environ[WORKLOAD_ENV]))
    n = ctx.task.group_size
    member = int(ctx.session_id[len(ctx.task.task_id) + 1 :].split("-")[0]) % n
    rng = random.Random(ctx.session_id)
    index = task_number(ctx.task.task_id)  # the scheduler admits them in that order
    max_tokens = max_tokens_of(ctx.task, ctx.max_tokens)
    messages = openai_messages(ctx.task.messages)
    answer = ""
    for turn in range(workload.agent.turns):
        if turn:
            await asyncio.sleep(workload.agent.latency_s(rng))
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "wrong"},
            ]
        group = workload.draw_seed(index, turn)
        message = await complete(ctx, messages, max_tokens, seed=group * n + member)
        answer = message.content or ""
        if ctx.verify(answer):
            break
    return AgentResult(answer=answer, turns=turn + 1)


# -- one arm ------------------------------------------------------------------------------------


def arm_config(arm: Arm, cluster: str, run: str, out: Path, args: argparse.Namespace) -> str:
    """The run TOML of ``arm``: equal devices, staleness bound and samples per step."""
    staleness = 0 if arm.synchronous else args.staleness
    devices, trainers = args.devices, 1 if arm.synchronous else args.trainer_devices
    workload = args.workload if cluster == "emulated" else None
    groups = workload.groups_per_step if workload else args.tiny_groups
    config = {
        # room for a prompt and the workload's longest answer
        "model": {
            "max_model_len": max(2048, workload.lengths.cap + 512) if workload else 512,
            "warm_start": {"steps": 0},
        },
        "rollout": {"workers": devices - trainers},  # and the trainer's process or workers
        # downweight by default: every arm trains every sample (in drop mode a step trains
        # fewer where some were stale); --stale drop shows what admission lets past the bound
        "trainer": {
            "groups_per_step": groups,
            "max_staleness": staleness,
            "staleness_mode": args.stale,
            **order_settings(args),
        },
        "scheduler": {"steps_ahead": staleness + 1},
        # a multiplexed trainer is its workers, a disaggregated one a process
        "layout": {
            "kind": arm.layout,
            "train": {"count": trainers if arm.layout == "multiplexed" else 1},
        },
        "tasks": {
            "group_size": workload.group_size if workload else 8,
            "backlog": 2 * groups * (staleness + 1),
            "max_turns": workload.agent.turns if workload else TINY_AGENT["turns"],
        },
        "agents": {
            "agent": "bench.pipeline:emulated_agent",
            "max_tasks": 4 * groups,
            "shutdown_grace_s": 0.0,  # the run is measured: stop at once
        },
        "stop": {"max_steps": args.warmup + args.steps, "max_seconds": 540},
    }
    if workload:
        table = workload.to_dict()
        config["tasks"]["max_tokens"] = workload.lengths.cap  # the engine's draws end it
        config["cpus"] = {"placement": "none"}  # nothing computes
        config["worker"] = {
            "max_running": 256,
            **({"max_waiting": args.max_waiting} if args.max_waiting else {}),
            "engine": {"kind": "emulated", "chunk_s": 0.5, "workload": table},
        }
        # a multiplexed trainer's workers are one device each (a trainer group), a
        # disaggregated trainer's process all of its devices
        modelled = devices if arm.synchronous else 1 if arm.layout == "multiplexed" else trainers
        config["trainer"]["backend"] = {"kind": "emulated", "devices": modelled, "workload": table}
    else:
        del config["model"]["warm_start"]  # the quickstart's warm start (cached)
    lines = [f'run = "{run}"', f'output_dir = "{out}"']
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    """``value`` (dicts, lists, strings, numbers, bools) as a TOML value; dicts inline."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


async def run_arm(arm: Arm, cluster: str, args: argparse.Namespace, tmp: Path) -> dict:
    """Run ``arm`` on a broker started here; time versions, scrape every process meanwhile."""
    from broker import codec
    from broker.client import session
    from broker.config import EmbeddedBrokerConfig
    from broker.messages import WeightsPublished
    from broker.server import EmbeddedBroker
    from broker.subjects import RunNames

    run = f"pipe{arm.name.replace('-', '')}{int(time.time())}"
    out = tmp / run
    config = tmp / f"{run}.toml"
    config.write_text(arm_config(arm, cluster, run, out, args))
    workload = args.workload if cluster == "emulated" else Workload(agent=_agent(TINY_AGENT))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", WORKLOAD_ENV: json.dumps(workload.to_dict())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    arrivals: dict[int, float] = {}
    scrapes = Scrapes(out / "scrape_targets.json")
    with EmbeddedBroker(
        EmbeddedBrokerConfig(state_dir=tmp / f"{run}-broker", insecure=True)
    ) as broker:
        async with session(broker.url, "bench-pipeline") as nc:

            async def on_weights(msg) -> None:
                version = codec.decode(WeightsPublished, msg.data).version
                arrivals.setdefault(version, time.monotonic())
                if version == args.warmup:
                    scrapes.mark()

            await nc.subscribe(RunNames(run).weights, cb=on_weights)
            command = [sys.executable, "-m", "seamlessflow.cli", "run", str(config)]
            started, cpu = time.monotonic(), CpuShare()
            proc = await asyncio.create_subprocess_exec(
                *command,
                "--nats",
                broker.url,
                env=env,
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            follow = asyncio.create_task(scrapes.follow())
            output, _ = await proc.communicate()
            follow.cancel()
    if proc.returncode != 0:
        raise ArmFailedError(f"{arm.name} failed:\n{output.decode(errors='replace')[-4000:]}")
    from seamlessflow.run import CHECKPOINTS
    from trainer.checkpoint import read_steps

    summary = json.loads((out / "summary.json").read_text())
    row = measure(arm, summary, read_steps(out / CHECKPOINTS), arrivals, scrapes, args, started)
    return {**row, **cpu.read()}  # the whole run's, start-up included


def _agent(spec: dict):
    from emulation.workload import AgentModel

    return AgentModel(**spec)


class Scrapes:
    """Every process's /metrics, scraped every ``SCRAPE_S`` from the run's ``file_sd`` file:
    the scrape at the end of the warm-up (``mark``) and the last one, per target."""

    def __init__(self, targets: Path) -> None:
        self.targets = targets
        self.first: dict[str, list] = {}
        self.last: dict[str, list] = {}
        self.gauges: dict[str, dict[str, list[float]]] = {name: {} for name in MEAN_GAUGES}
        """Per gauge of ``MEAN_GAUGES``, per process exporting it: its value at each scrape
        after the mark."""
        self._marked = False
        self._key: str | None = None  # the run's /metrics key, once it has written one

    def mark(self) -> None:
        self._marked = True

    def mean(self, gauge: str) -> float | None:
        """``gauge``'s mean over the scrapes after the mark, per process, then over processes."""
        series = [sum(v) / len(v) for v in self.gauges[gauge].values()]
        return round(sum(series) / len(series), 1) if series else None

    async def follow(self) -> None:
        from common.metrics import metric_sum, scrape
        from rollout.gateway.keys import read_key_file

        key_file = self.targets.parent / "metrics.key"  # the gateway's /metrics wants it
        while True:
            await asyncio.sleep(SCRAPE_S)
            if self._key is None and key_file.is_file():
                self._key = read_key_file(key_file)
            try:
                groups = json.loads(self.targets.read_text())
            except (OSError, ValueError):
                continue
            for group in groups:
                job = group["labels"]["job"].removeprefix("seamlessflow-")
                for target in group["targets"]:
                    try:
                        samples = await scrape(f"http://{target}/metrics", self._key)
                    except Exception:  # a process stopping or not serving yet
                        continue
                    process = f"{job}@{target}"
                    self.last[process] = samples
                    if self._marked:
                        self.first.setdefault(process, samples)
                        for name, series in self.gauges.items():
                            if any(s.name == name for s in samples):
                                series.setdefault(process, []).append(metric_sum(samples, name))


def measure(
    arm: Arm,
    summary: dict,
    steps_log: list,
    arrivals: dict[int, float],
    scrapes: Scrapes,
    args,
    started: float,
) -> dict:
    """The arm's row. Samples come from the trainer's steps log (``steps.jsonl``: each committed
    step's samples, trained at full weight or downweighted, and dropped), tokens from its
    counters, which count at the commit too; its samples counter counts when a step is planned,
    so a scrape between the plan and the commit of the step after the last held that step's
    samples (at 6 devices, 704 samples over 10 committed steps: 1.10x)."""
    from common.metrics import metric_sum

    start, end = args.warmup, args.warmup + args.steps
    if end not in arrivals or start not in arrivals:
        raise ArmFailedError(f"{arm.name}: versions {sorted(arrivals)} lack {start} or {end}")
    seconds = arrivals[end] - arrivals[start]
    trainer = next(
        (s for k, s in scrapes.last.items() if metric_sum(s, "sf_trainer_steps_total") > 0), []
    )
    steps = metric_sum(trainer, "sf_trainer_steps_total")
    tokens_per_step = metric_sum(trainer, "sf_trainer_tokens_total") / max(steps, 1)
    # trained: at full weight, or downweighted as stale (``downweight`` mode trains those too)
    trained = sum(len(r.trained) for r in steps_log)
    timed = sum(len(r.trained) for r in steps_log if start < r.version <= end)
    idle = {}
    for key, last in sorted(scrapes.last.items()):
        first = scrapes.first.get(key)
        if first is None or not any(s.name == "sf_worker_role_seconds_total" for s in last):
            continue
        total = _delta(first, last, "sf_worker_role_seconds_total")
        idle_s = _delta(first, last, "sf_worker_role_seconds_total", state="idle")
        idle[key] = round(idle_s / total, 3) if total else None
    scheduler = next((s for k, s in scrapes.last.items() if k.startswith("scheduler@")), [])
    costs = summary.get("costs", {})
    gateway = next((k for k in scrapes.last if k.startswith("gateway@")), None)
    overhead = None  # what the data plane added to each call after the warm-up, mean
    if gateway is not None and gateway in scrapes.first:
        first, last = scrapes.first[gateway], scrapes.last[gateway]
        calls = _delta(first, last, "sf_gateway_overhead_seconds_count")
        added = _delta(first, last, "sf_gateway_overhead_seconds_sum")
        overhead = round(1000 * added / calls, 1) if calls else None
    dropped = metric_sum(trainer, "sf_trainer_samples_dropped_total")
    dropped_tokens = metric_sum(trainer, "sf_trainer_tokens_dropped_total")
    trained_tokens = metric_sum(trainer, "sf_trainer_tokens_total")
    consumed_tokens = trained_tokens + dropped_tokens
    values = [v for v in idle.values() if v is not None]
    return {
        "arm": arm.name if args.orders == args.order else f"{arm.name}/{args.order}",
        "order": args.order,
        "order_wait_bound_s": order_settings(args).get("order_wait_s"),
        "layout": arm.layout,
        "steps": args.steps,
        "s_per_step": round(seconds / args.steps, 3),
        "time_to_steps_s": round(seconds, 2),
        "samples_per_s": round(timed / seconds, 3),
        "trained_tokens_per_s": round(tokens_per_step * args.steps / seconds, 1),
        "idle_mean": round(sum(values) / len(values), 3) if values else None,
        "idle_max": max(values) if values else None,
        "idle_per_worker": idle,
        **{f"{name}_mean": scrapes.mean(gauge) for gauge, name in MEAN_GAUGES.items()},
        "rollout": summary.get("rollout"),  # the workers' weight loads, pause and resume
        "plane_ms_per_call": overhead,
        # the agent's latencies as the calls' records show them (the workload's are modelled)
        "env_latency_s": costs.get("environment latency seconds (mean)"),
        "start_latency_s": costs.get("admission to first call seconds (mean)"),
        "lends": summary["scheduler"].get("lends", 0),
        "reclaims": summary["scheduler"].get("reclaims", 0),
        "reclaim_p50_s": _quantile(scheduler, "sf_scheduler_reclaim_seconds", 0.5),
        "reclaim_p99_s": _quantile(scheduler, "sf_scheduler_reclaim_seconds", 0.99),
        "staleness_mode": args.stale,
        "stale_downweighted": summary["trainer"].get("samples downweighted", 0),
        "stale_dropped": summary["trainer"].get("samples stale_dropped", 0),
        "length_bias": round(
            (trained_tokens / max(trained, 1)) / (consumed_tokens / max(trained + dropped, 1)), 3
        )
        if consumed_tokens
        else None,
        "thrown_away": round(dropped_tokens / consumed_tokens, 4) if consumed_tokens else None,
        "order_wait_s": summary["trainer"].get("admission order: seconds waited"),
        "order_given_up": summary["trainer"].get("admission order: tasks given up"),
        "stamp_gap_mean": summary["trainer"].get(
            "versions from admission stamp to oldest token (mean)"
        ),
        "trainer_step_s": summary["trainer"].get("step seconds (mean)"),
        "first_version_s": round(arrivals[min(arrivals)] - started, 1),  # start-up included
        "version_at_s": {v: round(t - started, 2) for v, t in sorted(arrivals.items())},
        "wall_s": round(time.monotonic() - started, 1),
    }


def _delta(first: list, last: list, name: str, **labels: str) -> float:
    from common.metrics import metric_sum

    return metric_sum(last, name, **labels) - metric_sum(first, name, **labels)


def _quantile(samples: list, name: str, q: float) -> float | None:
    """The ``q`` quantile of a histogram, interpolated linearly within its bucket."""
    buckets = sorted(
        (float(s.labels["le"]), s.value) for s in samples if s.name == f"{name}_bucket"
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / max(count - lower_count, 1e-9)
            return round(lower_bound + share * (bound - lower_bound), 4)
        lower_bound, lower_count = bound, count
    return None


# -- the simulator at the same parameters -------------------------------------------------------


def simulated(arm: Arm, args: argparse.Namespace) -> dict | None:
    """The simulator's figures for ``arm`` at the run's workload, devices, trainer devices,
    staleness and steps (``emulation.sim.simulate``, run in this process; ``--sim-path`` puts a
    checkout holding it first on the path). Its rates are steady-state (the first quarter of
    the steps left out), like the measured ones after the warm-up. None without a simulator."""
    if args.sim_path:
        sys.path.insert(0, str(args.sim_path))
    try:
        from emulation.sim import TrainerOrder, simulate
    except ImportError:
        return None

    steps = args.warmup + args.steps
    staleness = 0 if arm.synchronous else args.staleness
    trainer_devices = args.devices if arm.synchronous else args.trainer_devices
    r = simulate(
        args.workload,
        arm.name,
        args.devices,
        steps,
        staleness,
        trainer_devices,
        # the run's trainer in the simulator's terms (its ``completion`` is admission order
        # without a wait: the real trainer has no completion order)
        **TrainerOrder.of(
            TrainerConfig(staleness_mode=args.stale, **order_settings(args))
        ).simulated(),
    )
    return {
        "s_per_step": round(r.steady_s_per_step, 3),
        "samples_per_s": round(r.steady_samples_per_s, 3),
        "trained_tokens_per_s": round(r.steady_tokens_per_s, 1),
        "idle": {k: round(v, 3) for k, v in r.idle.items()},
        "mean_batch": round(r.mean_batch, 1),
        "reclaim_p50_s": round(r.reclaim_p50_s, 3),
        "reclaim_p99_s": round(r.reclaim_p99_s, 3),
        "lends": r.lends,
        "dropped_groups": r.dropped_groups,
        "dropped_samples": r.dropped_samples,
        "length_bias": round(r.length_bias, 3),
        "thrown_away": round(r.aborted_token_fraction, 4),
    }


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cluster", default="emulated", help="emulated, tiny or emulated,tiny")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--devices", type=int, default=16, help="of the emulated cluster")
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=2, help="of the asynchronous arms")
    parser.add_argument("--tiny-groups", type=int, default=4, help="groups per step, tiny model")
    parser.add_argument(
        "--stale",
        choices=("downweight", "drop"),
        default="downweight",
        help="trainer.staleness_mode; drop writes pipeline-drop.json (samples past the bound "
        "are not trained, so its rates are not comparable)",
    )
    parser.add_argument(
        "--orders", default="admission", help=f"trainer orders per arm, of {', '.join(ORDERS)}"
    )
    parser.add_argument(
        "--overlap-wait",
        type=float,
        default=OVERLAP_WAIT_S,
        help="the overlap order's trainer.order_wait_s: how long a step waits for an earlier "
        "task (other than 25: results in pipeline[-drop]-wait<S>.json)",
    )
    parser.add_argument(
        "--max-waiting", type=int, help="worker.max_waiting (unset: the worker's default)"
    )
    parser.add_argument(
        "--sim-path", type=Path, default=None, help="a checkout with emulation.sim, if not this one"
    )
    args = parser.parse_args()
    for cluster in args.cluster.split(","):
        if cluster not in ("emulated", "tiny"):
            parser.error(f"--cluster: unknown cluster {cluster!r}")
        devices = args.devices if cluster == "emulated" else 2  # this machine's 2 cores
        shape = {"devices": devices, "trainer_devices": 1, "workload": WORKLOAD}
        run_cluster(cluster, argparse.Namespace(**{**vars(args), **shape}))


def run_cluster(cluster: str, args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sf-bench-pipeline-") as tmp:
        for name, order in itertools.product(args.arms.split(","), args.orders.split(",")):
            arm = ARMS[name]
            print(f"{cluster}: {name} ({order} order) on {args.devices} devices ...", flush=True)
            ordered = argparse.Namespace(**vars(args), order=order)
            try:
                row = asyncio.run(run_arm(arm, cluster, ordered, Path(tmp)))
            except ArmFailedError as exc:  # the other arms still run
                print(exc, flush=True)
                continue
            if cluster == "emulated" and (sim := simulated(arm, ordered)) is not None:
                row["sim"] = sim
                row["ratio_to_sim"] = round(row["samples_per_s"] / sim["samples_per_s"], 3)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "idle_per_worker"}), flush=True)
    if not rows:
        return
    base = rows[0]["samples_per_s"]
    header = (
        f"{'arm':27s} {'s/step':>7s} {'samples/s':>9s} {'x ' + rows[0]['arm'][:6]:>9s} "
        f"{'tokens/s':>9s} {'idle mean':>9s} {'idle max':>8s} {'lends':>5s} "
        f"{'reclaim p50':>11s} {'p99':>6s} {'vs sim':>6s} {'dropped':>7s} {'order wait s':>12s} "
        f"{'length bias':>11s} {'thrown away':>11s}"
    )
    print(f"{cluster} cluster, {args.devices} devices")
    print(header)
    for row in rows:
        p50, p99 = row["reclaim_p50_s"], row["reclaim_p99_s"]
        print(
            f"{row['arm']:27s} {row['s_per_step']:7.2f} {row['samples_per_s']:9.2f} "
            f"{row['samples_per_s'] / base:9.2f} {row['trained_tokens_per_s']:9.0f} "
            f"{_fmt(row['idle_mean'])} {_fmt(row['idle_max'], 8)} {row['lends']:5.0f} "
            f"{_fmt(p50, 11)} {_fmt(p99, 6)} {_fmt(row.get('ratio_to_sim'), 6)} "
            f"{row['stale_dropped']:7.0f} {_fmt(row['order_wait_s'], 12)} "
            f"{_fmt(row['length_bias'], 11)} {_fmt(row['thrown_away'], 11)}"
        )
    name = "pipeline" if args.stale == "downweight" else f"pipeline-{args.stale}"
    if args.overlap_wait != OVERLAP_WAIT_S:
        name += f"-wait{args.overlap_wait:g}"
    path = RESULTS / f"{name}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    arms = results.get(cluster, {}).get("arms", {})  # arms run by other invocations stay
    results[cluster] = {
        "devices": args.devices,
        "steps": args.steps,
        "warmup": args.warmup,
        "staleness": args.staleness,
        "workload": args.workload.to_dict() if cluster == "emulated" else {"agent": TINY_AGENT},
        "machine": machine(),
        "arms": {**arms, **{row["arm"]: row for row in rows}},
    }
    write_results(path.name, results)
    print(f"wrote {path}")


def _fmt(value: float | None, width: int = 9) -> str:
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}s}"


if __name__ == "__main__":
    main()
