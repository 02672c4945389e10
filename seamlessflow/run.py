"""``seamlessflow run``: the whole RL loop on one machine.

1. Prepare the policy (build or unpack it, then the cached warm start).
2. Start the embedded broker (a fresh store under the run's output folder) or use ``--nats``,
   and provision the run.
3. Start the processes with fixed roles: trajectory manager, trainer, rollout workers, gateway,
   agent runner (each a ``seamlessflow`` child process serving ``/metrics``), and list every
   ``/metrics`` (the embedded broker's too, and workers that join through the registry) in
   ``scrape_targets.json`` for Prometheus (``seamlessflow.targets``).
4. Keep a small backlog of tasks queued, and show a live progress line built from the data plane
   (samples, call records, weight events) until the trainer reaches ``stop.max_steps``, time is
   up, a process dies, or Ctrl-C.
5. Stop the processes (agents first, so no new work starts), then print the summary and write it
   with the reward curve.
"""

import asyncio
import contextlib
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import codec
from broker.client import session
from broker.exceptions import InvalidMessageError
from broker.messages import CallRecorded, Message, SampleReady, WeightsPublished
from broker.provision import provision_run
from broker.subjects import Durable, RunNames
from broker.weights import latest_weights
from common.exceptions import SeamlessFlowError
from common.log import kv
from common.metrics import scrape
from common.models import resolve_model
from common.paths import default_state_dir
from rollout.agents import arithmetic
from seamlessflow.config import RunConfig
from seamlessflow.launcher import local_broker, stop_on_signals
from seamlessflow.placement import place
from seamlessflow.processes import ServiceProcess, worker_process
from seamlessflow.progress import RunStats
from seamlessflow.report import RunSummary, print_summary, summarize, trainer_report
from seamlessflow.submit import submit_tasks
from seamlessflow.targets import ScrapeTargets
from trainer.warmstart import warm_start

log = logging.getLogger(__name__)

TICK_S = 1.0
PLAIN_LINE_EVERY_S = 10.0
"""Without a terminal the progress line is printed as a new line this often."""
SCRAPE_TARGETS = "scrape_targets.json"
"""The run's Prometheus ``file_sd`` targets, in its output folder (``seamlessflow.targets``)."""


class RunFailedError(SeamlessFlowError):
    """A process of the run died or the run could not start."""


def prepare_model(config: RunConfig) -> Path:
    """The policy's starting folder: the base model, warm-started on the task when configured."""
    base = resolve_model(config.model.name)
    if config.tasks.env != "arithmetic":
        return base
    max_operand = config.tasks.max_operand

    def demonstration(rng: random.Random) -> tuple[list[dict[str, str]], str]:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        return [{"role": "user", "content": arithmetic.question(a, b)}], arithmetic.answer(a, b)

    return warm_start(base, config.model.warm_start, demonstration, f"arithmetic-{max_operand}")


def output_dir(config: RunConfig) -> Path:
    return config.output_dir or default_state_dir() / "runs" / config.run


async def run_rl(config: RunConfig, config_path: Path | None, nats: str | None) -> RunSummary:
    """Run the loop described in the module docstring; return its summary."""
    stop = stop_on_signals()
    out = output_dir(config)
    print(f"seamlessflow run {config.run!r}: preparing the model ...", flush=True)
    model = await asyncio.to_thread(prepare_model, config)
    if nats is None:
        shutil.rmtree(out / "broker", ignore_errors=True)  # every run starts from a fresh store
    broker = config.broker.model_copy(update={"state_dir": out / "broker"})
    names = RunNames(config.run)
    async with (
        local_broker(nats, broker) as embedded,
        session(embedded.url, "seamlessflow-run") as nc,
    ):
        url = embedded.url
        js = nc.jetstream()
        await provision_run(js, config.run, config.provision)
        if (existing := await latest_weights(js, names)) is not None:
            raise RunFailedError(
                f"run {config.run!r} on {url} already has weight version {existing.version}: "
                "choose another run name for a new run"
            )
        targets = ScrapeTargets(out / SCRAPE_TARGETS, config.run)
        if embedded.metrics_url:
            targets.add(embedded.metrics_url, "broker")
        print(f"broker {url}, model {model}, output {out}", flush=True)
        print(f"prometheus targets (file_sd): {targets.path}", flush=True)
        follow = asyncio.create_task(targets.follow(js, names))
        services = Services(url, config, config_path, model)
        stats = RunStats()
        started = time.time()
        try:
            await services.start(targets)
            stats.started_at = time.time()
            stopped_by = await _watch(nc, names, config, services, stats, stop)
            trainer = await _trainer_report(services)
        finally:
            await asyncio.to_thread(services.stop)
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            targets.clear()
    summary = summarize(config.run, stats, time.time() - started, out, stopped_by, trainer)
    print_summary(summary)
    return summary


async def _watch(
    nc: Client,
    names: RunNames,
    config: RunConfig,
    services: "Services",
    stats: RunStats,
    stop: asyncio.Event,
) -> str:
    """Feed tasks and print progress until the run is over; return what ended it."""
    subs = [
        await nc.subscribe(names.samples, cb=_feed(SampleReady, stats.on_sample)),
        await nc.subscribe(names.traj_calls_all, cb=_feed(CallRecorded, stats.on_call)),
        await nc.subscribe(names.weights, cb=_feed(WeightsPublished, stats.on_weights)),
    ]
    tasks = TaskFeed(nc, names, config)
    tty = sys.stdout.isatty()
    last_line = 0.0
    try:
        while True:
            now = time.time()
            if stop.is_set():
                return "interrupted"
            if stats.version >= config.stop.max_steps:
                return f"max_steps ({config.stop.max_steps})"
            if now - stats.started_at >= config.stop.max_seconds:
                return f"max_seconds ({config.stop.max_seconds:g})"
            services.check()
            await tasks.top_up()
            if tty:
                print("\r" + stats.line(now), end="", flush=True)
            elif now - last_line >= PLAIN_LINE_EVERY_S:
                print(stats.line(now), flush=True)
                last_line = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)
    finally:
        if tty:
            print(flush=True)
        for sub in subs:
            await sub.unsubscribe()


async def _trainer_report(services: "Services") -> dict[str, float]:
    try:
        return trainer_report(await scrape(services.named("trainer").metrics_url))
    except httpx.HTTPError as exc:
        log.warning(kv("trainer_metrics_unreadable", error=exc))
        return {}


def _feed(schema: type[Message], handle: Callable) -> Callable:
    async def callback(msg: Msg) -> None:
        try:
            content_type = codec.content_type_of(msg.headers)
            message = codec.decode(schema, msg.data, content_type=content_type)
        except InvalidMessageError as exc:
            log.warning(kv("progress_message_skipped", subject=msg.subject, error=exc.reason))
            return
        handle(message, time.time())

    return callback


class TaskFeed:
    """Feeds the built-in tasks (none for env 'none'), one group per task, with admission
    control: the groups not yet taken by the trainer (tasks queued or being run, samples the
    trainer has not settled) stay within ``tasks.steps_ahead`` trainer steps, so rollout never
    runs far past the staleness bound while the trainer works. Both counts are the broker's
    consumer states; nothing is asked of the other processes."""

    def __init__(self, nc: Client, names: RunNames, config: RunConfig) -> None:
        self._js = nc.jetstream()
        self._names = names
        self._config = config.tasks
        self._limit = config.tasks.steps_ahead * config.trainer.groups_per_step
        self._rng = random.Random(config.tasks.seed)
        self._next = 0

    async def top_up(self) -> None:
        if self._config.env == "none":
            return
        tasks_info = await self._js.consumer_info(self._names.tasks_stream, Durable.AGENTS)
        samples_info = await self._js.consumer_info(self._names.samples_stream, Durable.TRAINER)
        unsettled = samples_info.num_pending + samples_info.num_ack_pending
        outstanding = (
            tasks_info.num_pending
            + tasks_info.num_ack_pending
            + unsettled // self._config.group_size
        )
        missing = min(self._limit - outstanding, self._config.backlog - tasks_info.num_pending)
        if missing <= 0:
            return
        tasks = arithmetic.arithmetic_tasks(
            self._rng,
            missing,
            max_operand=self._config.max_operand,
            group_size=self._config.group_size,
            max_turns=self._config.max_turns,
            max_tokens=self._config.max_tokens,
            prefix=f"t{self._next}",
        )
        self._next += 1
        await submit_tasks(self._js, self._names, tasks, progress=False)


@dataclass
class Services:
    """The run's child processes, started in dependency order and stopped in reverse."""

    url: str
    config: RunConfig
    config_path: Path | None
    model: Path

    def __post_init__(self) -> None:
        self.running: list[ServiceProcess] = []

    async def start(self, targets: ScrapeTargets) -> None:
        """Start every process; each becomes a scrape target once it serves."""
        cfg = self.config
        config_args = ["--config", str(self.config_path)] if self.config_path else []
        where = ["--nats", self.url, "--run", cfg.run]
        common = [*where, *config_args]
        cpus = place(cfg.cpus, cfg.trainer, cfg.rollout, os.sched_getaffinity(0))
        print("starting trajectory manager, trainer, rollout workers, gateway ...", flush=True)
        first = [
            ServiceProcess("trajectory", "trajectory", *common),
            ServiceProcess(
                "trainer",
                "trainer",
                *common,
                "--model",
                str(self.model),
                "--threads",
                str(cpus.trainer.threads),
                threads=cpus.trainer.threads,
                cpus=cpus.trainer.cpus,
            ),
        ]
        first += [
            worker_process(
                self.url,
                cfg.run,
                self.model,
                f"rollout-{i}",
                *config_args,  # its [model] and [worker] sections
                threads=worker.threads,
                cpus=worker.cpus,
            )
            for i, worker in enumerate(cpus.workers)
        ]
        gateway = ServiceProcess(
            "gateway",
            "gateway",
            *common,  # its [model] and [gateway] sections
            "--model",
            str(self.model),
            "--port",
            "0",
        )
        self.running = [*first, gateway]
        await self._ready(self.running)
        for proc in self.running:
            targets.add(proc.metrics_url, proc.command)
        gateway_url = gateway.metrics_url.removesuffix("/metrics") + "/v1"
        agents = ServiceProcess("agents", "agents", *common, "--gateway", gateway_url)
        self.running.append(agents)
        await self._ready([agents])
        targets.add(agents.metrics_url, agents.command)
        for proc in self.running:
            print(f"  {proc.name:12s} pid {proc.proc.pid:7d}  {proc.metrics_url}", flush=True)

    @staticmethod
    async def _ready(procs: list[ServiceProcess]) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.wait_ready, 600.0) for p in procs))

    def named(self, name: str) -> ServiceProcess:
        return next(p for p in self.running if p.name == name)

    def check(self) -> None:
        """Raise if a process has exited."""
        for proc in self.running:
            if (code := proc.proc.poll()) is not None:
                tail = "".join(list(proc.output)[-40:])
                raise RunFailedError(f"{proc.name} exited with code {code}:\n{tail}")

    def stop(self) -> None:
        for proc in reversed(self.running):
            try:
                proc.stop(timeout=60.0)
            except SeamlessFlowError as exc:
                log.error(kv("service_stop_failed", service=proc.name, error=exc))
        self.running = []
