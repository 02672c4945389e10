"""``seamlessflow run``: the whole RL loop on one machine.

1. Prepare the policy (build or unpack it, then the cached warm start: ``warm_start``).
2. Start the embedded broker (a fresh store under the run's output folder) or use ``--nats``,
   and provision the run.
3. Start the processes with fixed roles: trajectory manager, trainer, rollout workers, gateway,
   agent runner (each a ``seamlessflow`` child process serving ``/metrics``, started with
   ``--config`` and nothing else: its resolved, validated run config, written to the run's
   output folder under ``configs/``; the broker's URL is in its environment), and list every
   ``/metrics`` (the embedded broker's too, and workers that join through the registry) in
   ``scrape_targets.json`` for Prometheus (``seamlessflow.targets``).
4. Keep a small backlog of tasks queued (``feed``), and show a live progress line built from the
   data plane (samples, call records, weight events) until the trainer reaches
   ``stop.max_steps``, time is up, a process keeps failing, or Ctrl-C. A process that exits is
   restarted after a backoff (``[supervise]``); the progress line names what was restarted and
   what is down.
5. Stop the processes (agents first, so no new work starts), then print the summary and write it
   with the reward curve.
"""

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import codec
from broker.auth import IDENTITIES_ENV, IDENTITY_ENV
from broker.client import session
from broker.exceptions import InvalidMessageError
from broker.messages import (
    CallRecorded,
    Message,
    Role,
    SampleReady,
    SessionEnded,
    WeightsPublished,
)
from broker.permissions import Principal
from broker.provision import provision_run
from broker.registry import node_name
from broker.retry import TRANSIENT, Backoff
from broker.subjects import RunNames
from broker.tls import CA_ENV
from broker.weights import latest_weights
from common.log import kv
from common.metrics import scrape_all
from common.paths import default_state_dir
from rollout.gateway.keys import RunKeys, write_run_keys
from seamlessflow.config import RunConfig, override
from seamlessflow.costs import trainer_workers
from seamlessflow.exceptions import RunFailedError
from seamlessflow.feed import TaskFeed
from seamlessflow.launcher import Broker, local_broker, stop_on_signals, workers_and_leader
from seamlessflow.placement import CpuPlan, CpuSet, place
from seamlessflow.processes import ServiceProcess, SuperviseConfig, stop_all
from seamlessflow.progress import RunStats
from seamlessflow.report import (
    RunSummary,
    node_parts,
    print_summary,
    rollout_report,
    scheduler_report,
    summarize,
    trainer_report,
)
from seamlessflow.targets import ScrapeTargets
from seamlessflow.warm_start import prepare_model
from tagsched.spec import Layout

log = logging.getLogger(__name__)

TICK_S = 1.0
PLAIN_LINE_EVERY_S = 10.0
"""Without a terminal the progress line is printed as a new line this often."""
SCRAPE_TARGETS = "scrape_targets.json"
"""The run's Prometheus ``file_sd`` targets, in its output folder (``seamlessflow.targets``)."""


CONFIGS = "configs"
"""Each child's resolved run config (``<name>.json``), in the run's output folder."""

CHECKPOINTS = "checkpoints"
"""The trainer's checkpoints, in the run's output folder, unless ``trainer.checkpoint_dir`` is
set: a restarted trainer resumes from them."""


def output_dir(config: RunConfig) -> Path:
    return config.output_dir or default_state_dir() / "runs" / config.run


async def run_rl(config: RunConfig, nats: str | None) -> RunSummary:
    """Run the loop described in the module docstring; return its summary."""
    trainer_workers(config)  # refuses a train count it would not start, before anything runs
    stop = stop_on_signals()
    out = output_dir(config)
    print(f"seamlessflow run {config.run!r}: preparing the model ...", flush=True)
    model = await asyncio.to_thread(prepare_model, config)
    if nats is None:
        shutil.rmtree(out / "broker", ignore_errors=True)  # every run starts from a fresh store
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)  # and a new run from the model
    shutil.rmtree(out / CONFIGS, ignore_errors=True)
    keys = _gateway_keys(config, out)
    broker = override(config, {"broker": {"state_dir": str(out / "broker")}}).broker
    names = RunNames(config.run)
    async with (
        local_broker(nats, broker, config.run) as embedded,
        session(
            embedded.url, "seamlessflow-run", identity_file=embedded.admin, ca_file=embedded.ca
        ) as nc,
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
        services = Services(embedded, config, model, out / CHECKPOINTS, out / CONFIGS, keys)
        stats = RunStats()
        started = time.time()
        try:
            await services.start(targets)
            stats.started_at = time.time()
            stopped_by = await _watch(nc, names, config, services, stats, stop)
            trainer = await _report([services.named("trainer")], trainer_report)
            scheduler = await _report([services.named("scheduler")], scheduler_report)
            engines = [p for p in services.running if p.command == "worker"]
            rollout = await _report(engines, rollout_report)
            workers, leader = await workers_and_leader(js, names)
            nodes = node_parts(targets.groups(), workers, node_name())
        finally:
            await asyncio.to_thread(services.stop)
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            targets.clear()
    seconds = time.time() - started
    summary = summarize(
        config,
        stats,
        seconds,
        out,
        stopped_by,
        trainer,
        scheduler,
        rollout,
        nodes=nodes,
        scheduler_lease=leader,
    )
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
        await nc.subscribe(names.traj_end, cb=_feed(SessionEnded, stats.on_end)),
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
            services.supervise()
            try:
                await tasks.top_up()
            except TRANSIENT as exc:  # the broker is restarting: top up on a later tick
                log.info(kv("tasks_not_topped_up", error=f"{type(exc).__name__}: {exc}"))
            line = stats.line(now) + services.status()
            if tty:
                print("\r" + line, end="", flush=True)
            elif now - last_line >= PLAIN_LINE_EVERY_S:
                print(line, flush=True)
                last_line = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)
    finally:
        if tty:
            print(flush=True)
        for sub in subs:
            await sub.unsubscribe()


async def _report(procs: list[ServiceProcess], report: Callable) -> dict[str, float]:
    """``report`` of the /metrics of ``procs`` together, leaving out those that cannot be read;
    empty if none can."""
    samples = await scrape_all([proc.metrics_url for proc in procs])
    return report(samples) if samples else {}


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


def _gateway_keys(config: RunConfig, out: Path) -> RunKeys | None:
    """A fresh keys file for the run's gateway in ``out`` (``rollout.gateway.keys``), with the
    agent runner's key and the ``/metrics`` key (``metrics.key``, a Prometheus
    ``credentials_file``); None when the config names a keys file of its own (then its
    ``[agents] gateway_key_file`` gives the agents their key)."""
    if config.gateway.keys_file is not None:
        if config.agents.gateway_key_file is None:
            raise RunFailedError(
                f"[gateway] keys_file is {config.gateway.keys_file}: set [agents] "
                "gateway_key_file to a file holding one of its openai keys, for the agents"
            )
        return None
    keys = write_run_keys(out)
    print(f"gateway keys: {keys.keys_file} (/metrics key: {keys.metrics_key_file})", flush=True)
    return keys


@dataclass
class Services:
    """The run's child processes, started in dependency order and stopped in reverse. Each is
    started with ``--config <configs>/<name>.json`` only: the run config with what is the
    child's own (its model folder, worker id, tags, role, CPUs' threads, ports) resolved and the
    whole validated, so a child never sees a setting its parent did not check."""

    broker: Broker
    """Each child connects to its URL as its principal's identity file when it has them (else
    it inherits this process's ``$SEAMLESSFLOW_NATS_IDENTITY``, or none), with its CA."""
    config: RunConfig
    model: Path
    checkpoint_dir: Path
    """The trainer's, when the config sets none: a restarted trainer resumes from it."""
    configs: Path
    keys: RunKeys | None = None
    """The gateway's keys file and the agents' key (``_gateway_keys``); None: the config's."""

    def __post_init__(self) -> None:
        self.running: list[ServiceProcess] = []
        self._supervised: dict[str, _Supervised] = {}
        self._targets: ScrapeTargets | None = None

    def resolve(self, name: str, changes: dict[str, Any]) -> Path:
        """Write the child ``name``'s config: the run's with ``changes`` (nested like the TOML),
        validated as a whole; return its path."""
        resolved = override(self.config, {"model": {"name": str(self.model)}, **changes})
        self.configs.mkdir(parents=True, exist_ok=True)
        path = self.configs / f"{name}.json"
        path.write_text(resolved.model_dump_json(indent=2) + "\n")
        return path

    def child(
        self, name: str, command: str, changes: dict[str, Any], where: CpuSet | None = None
    ) -> ServiceProcess:
        """``seamlessflow <command> --config <its resolved config>``, on ``where``'s CPUs."""
        threads, cpus = (1, None) if where is None else (where.threads, where.cpus)
        broker = self.broker
        env = {"SEAMLESSFLOW_NATS_URL": broker.url, "SEAMLESSFLOW_RUN": self.config.run}
        if broker.ca:
            env[CA_ENV] = str(broker.ca)
        if broker.identities:
            # each child connects as its own principal's file there (a worker tagged train as
            # the trainer: it holds one, and the trainer's rights cover rollout's)
            env[IDENTITIES_ENV] = str(broker.identities[Principal.ADMIN].parent)
            env[IDENTITY_ENV] = ""  # not one inherited from this shell
        path = self.resolve(name, changes)
        return ServiceProcess(
            name, command, "--config", str(path), threads=threads, cpus=cpus, env=env
        )

    async def start(self, targets: ScrapeTargets) -> None:
        """Start every process; each becomes a scrape target once it serves."""
        layout = self.config.layout.kind
        cpus = place(
            self.config.cpus, self.config.trainer, self.config.rollout, os.sched_getaffinity(0)
        )
        print(
            f"starting scheduler ({layout}), trajectory manager, trainer, rollout workers, "
            "gateway ...",
            flush=True,
        )
        first = [
            self.child("scheduler", "scheduler", {}),
            self.child("trajectory", "trajectory", {}),
            *self._trainer_and_workers(layout, cpus),
        ]
        keyed = {} if self.keys is None else {"keys_file": str(self.keys.keys_file)}
        gateway = self.child("gateway", "gateway", {"gateway": {"port": 0, **keyed}})
        self.running = [*first, gateway]
        await self._ready(self.running)
        for proc in self.running:
            targets.add(proc.metrics_url, proc.command)
        gateway_url = gateway.metrics_url.removesuffix("/metrics") + "/v1"
        # A restarted gateway must listen where the agents call it.
        self.resolve("gateway", {"gateway": {"port": urlparse(gateway_url).port, **keyed}})
        key = {} if self.keys is None else {"gateway_key_file": str(self.keys.openai_key_file)}
        agents = self.child("agents", "agents", {"agents": {"gateway": gateway_url, **key}})
        self.running.append(agents)
        await self._ready([agents])
        targets.add(agents.metrics_url, agents.command)
        for proc in self.running:
            print(f"  {proc.name:12s} pid {proc.proc.pid:7d}  {proc.metrics_url}", flush=True)
        self._targets = targets
        self._supervised = {p.name: _Supervised(p) for p in self.running}

    def _trainer_and_workers(self, layout: Layout, cpus: CpuPlan) -> list[ServiceProcess]:
        """The trainer and the rollout workers, tagged for ``layout`` (``tagsched.spec``) and placed
        on ``cpus`` (``seamlessflow.placement``): disaggregated, a trainer process on the trainer's
        CPUs (``[layout.train] count`` workers tagged ``train``, no engine, when the count is above
        one: one trainer group) and ``rollout.workers`` rollout workers on the rollout CPUs;
        multiplexed, the trainer is ``[layout.train] count`` workers (one by default) tagged
        ``train,rollout`` on the trainer's CPUs, one trainer group (lent to rollout while it waits:
        those CPUs generate then); colocated, ``rollout.workers`` workers tagged both run anywhere,
        sharing the CPUs (training on their share, generating on ``rollout.threads``), time-shared
        between training and rollout: those the scheduler assigns ``train`` (``[layout.train]
        count``, one by default) form the trainer group (``trainer.group``; only its rank 0 takes
        samples), the rest generate. Whatever holds a trainer checkpoints to ``checkpoint_dir``
        unless the config sets one (so a restart, or a member that becomes rank 0, resumes)."""
        cfg = self.config
        checkpoints = (
            {} if cfg.trainer.checkpoint_dir else {"checkpoint_dir": str(self.checkpoint_dir)}
        )

        def worker(name: str, worker_id: str, tags: list[str], role: Role, where: CpuSet):
            changes: dict[str, Any] = {
                "worker": {"worker_id": worker_id, "tags": tags, "role": role.value}
            }
            if "train" in tags:
                changes["trainer"] = {**checkpoints, "threads": where.threads}
            if layout is Layout.COLOCATED and getattr(cfg.worker.engine, "threads", 0) is None:
                # It trains on all its CPUs but generates beside the broker, the gateway and the
                # agents on the same CPUs, where an engine on as many torch threads stalls
                # (docs/performance.md, "A colocated worker's engine threads"): its engine (one
                # with a threads option, unset) gets a rollout worker's threads.
                changes["worker"]["engine"] = {"threads": cfg.rollout.threads}
            return self.child(name, "worker", changes, where)

        if layout is Layout.COLOCATED:
            n = max(1, cfg.rollout.workers)
            anywhere = CpuSet(None, max(1, len(os.sched_getaffinity(0)) // n))
            # worker-0 is named trainer: the one the progress report reads (assigned train
            # first, the ids in order: the group's rank 0)
            return [
                worker(
                    "trainer" if i == 0 else f"worker-{i}",
                    f"worker-{i}",
                    ["train", "rollout"],
                    Role.IDLE,
                    anywhere,
                )
                for i in range(n)
            ]
        rollout = [
            worker(f"rollout-{i}", f"rollout-{i}", ["rollout"], Role.ROLLOUT, where)
            for i, where in enumerate(cpus.workers)
        ]
        k = trainer_workers(cfg)
        if layout is Layout.MULTIPLEXED or k > 1:
            where = CpuSet(cpus.trainer.cpus, max(1, cpus.trainer.threads // k))  # shared
            tags = ["train", "rollout"] if layout is Layout.MULTIPLEXED else ["train"]
            # trainer-0 is named trainer: the one the progress report reads (the group's rank 0)
            trainers = [
                worker(f"trainer-{i}" if i else "trainer", f"trainer-{i}", tags, Role.TRAIN, where)
                for i in range(k)
            ]
            return [*trainers, *rollout]
        changes = {"trainer": {**checkpoints, "threads": cpus.trainer.threads}}
        return [self.child("trainer", "trainer", changes, cpus.trainer), *rollout]

    @staticmethod
    async def _ready(procs: list[ServiceProcess]) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.wait_ready, 600.0) for p in procs))

    def named(self, name: str) -> ServiceProcess:
        return next(p for p in self.running if p.name == name)

    def supervise(self) -> None:
        """Restart the processes that exited, each after its backoff; raise when one exited
        more than ``supervise.max_restarts`` times in a row (never up ``stable_s`` between)."""
        cfg = self.config.supervise
        for s in self._supervised.values():
            if s.tick(cfg) and self._targets is not None:  # serving again: a new /metrics
                self._targets.add(s.proc.metrics_url, s.proc.command)
            if s.failures > cfg.max_restarts:
                raise RunFailedError(
                    f"{s.proc.name} exited {s.failures} times in a row (last code "
                    f"{s.proc.proc.returncode}); giving up:\n{s.proc.tail(40)}"
                )

    def status(self) -> str:
        """For the progress line: what was restarted, and what is down now."""
        parts = [s.status() for s in self._supervised.values()]
        return "".join(f" | {p}" for p in parts if p)

    def stop(self) -> None:
        started, count = time.monotonic(), len(self.running)
        for exc in stop_all(self.running, timeout=60.0):
            log.error(kv("service_stop_failed", error=exc))
        self.running = []
        print(f"stopped {count} processes in {time.monotonic() - started:.1f} s", flush=True)


class _Supervised:
    """One child's supervision: when it exits, a restart after ``backoff_s`` doubling per exit
    in a row (up to ``backoff_max_s``); ``failures`` counts the exits in a row and resets once
    it stays up ``stable_s``."""

    def __init__(self, proc: ServiceProcess) -> None:
        self.proc = proc
        self.failures = 0
        self.restarts = 0
        self._due: float | None = None  # time.monotonic() of the pending restart
        self._announced = True  # the new process's ready line was acted on

    def tick(self, cfg: SuperviseConfig) -> bool:
        """Advance; True when a restarted process has just become ready."""
        now = time.monotonic()
        code = self.proc.proc.poll()
        if code is None:
            if self.failures and now - self.proc.started_at >= cfg.stable_s:
                self.failures = 0
            if not self._announced and self.proc.serving:
                self._announced = True
                p = self.proc
                print(f"\n{p.name} serving again (pid {p.proc.pid})  {p.metrics_url}", flush=True)
                log.info(kv("service_restarted", service=self.proc.name, pid=self.proc.proc.pid))
                return True
            return False
        if self._due is None:  # it has just exited
            self.failures += 1
            delay = Backoff(cfg.backoff_s, cfg.backoff_max_s).delay(self.failures)
            self._due = now + delay
            log.warning(kv("service_exited", service=self.proc.name, code=code, restart_in_s=delay))
            if self.failures <= cfg.max_restarts:
                print(
                    f"\n{self.proc.name} exited with code {code}: restarting in {delay:g}s",
                    flush=True,
                )
        elif now >= self._due and self.failures <= cfg.max_restarts:
            self._due = None
            self.restarts += 1
            self._announced = False
            # why it exited, for whoever reads the run (its output is read by now: the backoff)
            print(f"--- {self.proc.name}'s last lines ---\n{self.proc.tail()}", end="", flush=True)
            self.proc.restart()
        return False

    def status(self) -> str:
        if self.proc.proc.poll() is not None:
            return f"{self.proc.name} down"
        if self.restarts:
            return f"{self.proc.name} restarted {self.restarts}x"
        return ""
