"""``seamlessflow``: the command line. Each subcommand is a thin wrapper over a library call."""

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from broker.client import session
from broker.config import EmbeddedBrokerConfig
from broker.messages import TaskSubmitted
from broker.provision import provision_run, run_status
from broker.schema import export_schemas
from broker.subjects import RunNames
from common.exceptions import SeamlessFlowError
from common.log import setup_logging
from common.models import MODELS, resolve_model
from rollout.agents.config import AgentsConfig
from rollout.agents.runner import serve_agents
from rollout.engines import ENGINES, EngineConfig
from rollout.gateway import GatewayConfig, serve_gateway
from rollout.worker import WorkerConfig
from seamlessflow.config import DEFAULT_RUN, ConfigError, load_config
from seamlessflow.launcher import (
    print_status,
    serve_broker,
    serve_until_signalled,
    serve_worker,
)
from seamlessflow.run import run_rl
from seamlessflow.submit import SubmitReport, parse_tasks, submit_tasks
from trainer.config import TrainerConfig
from trainer.service import serve_trainer
from trajectory.manager import serve_trajectory


def _add_nats(p: argparse.ArgumentParser, *, embedded: bool = False) -> None:
    default = os.environ.get("SEAMLESSFLOW_NATS_URL")
    help_text = "NATS URL (default: $SEAMLESSFLOW_NATS_URL"
    help_text += ", else an embedded broker)" if embedded else ")"
    p.add_argument("--nats", default=default, required=not (embedded or default), help=help_text)


def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run",
        default=os.environ.get("SEAMLESSFLOW_RUN"),
        help="run name (default: $SEAMLESSFLOW_RUN, then a given --config's run, then "
        "'quickstart')",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seamlessflow", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("SEAMLESSFLOW_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="run the embedded NATS JetStream broker until Ctrl-C")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="client port (0: a free one)")
    p.add_argument("--state-dir", type=Path, help="store, config and log of the server")
    p.add_argument("--nats-server", type=Path, help="nats-server binary to run")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")

    p = sub.add_parser("provision", help="create a run's streams, consumers and buckets")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--config", type=Path, help="TOML run config (its [provision] section)")

    p = sub.add_parser("status", help="show the depth of a run's streams and consumers")
    _add_nats(p)
    _add_run(p)

    p = sub.add_parser("submit", help="publish tasks from a JSONL file ('-' for stdin)")
    _add_nats(p)
    _add_run(p)
    p.add_argument("tasks", help="JSONL file, one TaskSubmitted per line")

    p = sub.add_parser("schema", help="wire schemas")
    schema_sub = p.add_subparsers(dest="schema_command", required=True)
    e = schema_sub.add_parser("export", help="write a JSON Schema file per message")
    e.add_argument("dir", type=Path)

    p = sub.add_parser("worker", help="run a rollout worker until Ctrl-C")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--config", type=Path, help="TOML run config (its [provision] section)")
    p.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or an HF model folder")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--worker-id", help="default: <host>-<pid>")
    p.add_argument("--tags", default="rollout", help="comma-separated capability tags")
    p.add_argument("--max-running", type=int, default=16, help="requests generated at once")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")

    p = sub.add_parser("gateway", help="serve the OpenAI-compatible API until Ctrl-C")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or an HF model folder")
    p.add_argument("--served-model-name", help="the model name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one)")
    p.add_argument("--max-model-len", type=int, help="default: the model's context length")
    p.add_argument("--stall-timeout", type=float, default=5.0, help="seconds; then continue")
    p.add_argument("--queue-timeout", type=float, default=600.0, help="seconds; then 503")
    p.add_argument("--max-attempts", type=int, default=8, help="per call; then 503")

    p = sub.add_parser("model", help="build or unpack a model for CPU and print its folder")
    p.add_argument("name", choices=sorted(MODELS))

    p = sub.add_parser("trajectory", help="run the trajectory manager until Ctrl-C")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--config", type=Path, help="TOML run config (its [trajectory] section)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")

    p = sub.add_parser("agents", help="run agents on a run's tasks against a gateway until Ctrl-C")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--gateway", required=True, help="gateway URL (with or without /v1)")
    p.add_argument("--config", type=Path, help="TOML run config (its [agents] section)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--agent", help="'module:function': an async agent for every task")
    kind.add_argument(
        "--command",
        dest="agent_command",  # not `command`: that one names the subcommand
        help="an external agent command, run once per attempt",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")

    p = sub.add_parser("trainer", help="run the trainer (all its ranks) until Ctrl-C")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or an HF model folder")
    p.add_argument("--config", type=Path, help="TOML run config (its [trainer] section)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")
    p.add_argument("--world-size", type=int, help="local data-parallel ranks (default: config)")

    p = sub.add_parser(
        "run", help="run the whole RL loop on this machine (embedded broker by default)"
    )
    p.add_argument("config", nargs="?", type=Path, help="TOML run config (default: quickstart)")
    _add_nats(p, embedded=True)
    _add_run(p)
    return parser


async def _provision(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    run = args.run or config.run
    async with session(args.nats, "seamlessflow-provision") as nc:
        report = await provision_run(nc.jetstream(), run, config.provision)
    print(f"run {run!r}: {len(report.created)} created, {len(report.unchanged)} unchanged")
    for name in report.created:
        print(f"  created {name}")
    return 0


async def _status(args: argparse.Namespace) -> int:
    async with session(args.nats, "seamlessflow-status") as nc:
        status = await run_status(nc.jetstream(), args.run or DEFAULT_RUN)
    print_status(status)
    return 1 if status.missing else 0


def _submit(args: argparse.Namespace) -> int:
    if args.tasks == "-":
        tasks, errors = parse_tasks(sys.stdin, "<stdin>")
    else:
        try:
            with open(args.tasks) as f:
                tasks, errors = parse_tasks(f, args.tasks)
        except OSError as exc:
            raise SeamlessFlowError(f"cannot read {args.tasks}: {exc}") from exc
    for error in errors:
        print(error, file=sys.stderr)
    names = RunNames(args.run or DEFAULT_RUN)
    report = asyncio.run(_publish(args.nats, names, tasks))
    print(
        f"submitted {report.published} tasks to {names.tasks} "
        f"({report.duplicates} duplicates, {len(errors)} invalid)"
    )
    return 1 if errors else 0


async def _publish(url: str, names: RunNames, tasks: list[TaskSubmitted]) -> SubmitReport:
    async with session(url, "seamlessflow-submit") as nc:
        return await submit_tasks(nc.jetstream(), names, tasks)


def _broker(args: argparse.Namespace) -> int:
    fields = {"host": args.host, "port": args.port, "binary": args.nats_server}
    fields["metrics_port"] = args.metrics_port
    if args.state_dir:
        fields["state_dir"] = args.state_dir
    try:
        config = EmbeddedBrokerConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(f"broker settings: {exc}") from exc
    asyncio.run(serve_broker(config))
    return 0


def _schema(args: argparse.Namespace) -> int:
    for path in export_schemas(args.dir):
        print(path)
    return 0


def _worker(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    run = args.run or config.run
    options = dict(_key_value(option) for option in args.engine_option)
    engine_config = EngineConfig(
        model=resolve_model(args.model), max_model_len=args.max_model_len, options=options
    )
    fields = {"tags": [t for t in args.tags.split(",") if t], "max_running": args.max_running}
    if args.worker_id:
        fields["worker_id"] = args.worker_id
    try:
        worker = WorkerConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(f"worker settings: {exc}") from exc
    asyncio.run(
        serve_worker(
            args.nats, run, config.provision, args.engine, engine_config, worker, args.metrics_port
        )
    )
    return 0


def _gateway(args: argparse.Namespace) -> int:
    try:
        config = GatewayConfig(
            model=args.served_model_name or args.model,
            model_path=resolve_model(args.model),
            run=args.run or DEFAULT_RUN,
            host=args.host,
            port=args.port,
            max_model_len=args.max_model_len,
            stall_timeout_s=args.stall_timeout,
            queue_timeout_s=args.queue_timeout,
            max_attempts=args.max_attempts,
        )
    except ValidationError as exc:
        raise ConfigError(f"gateway settings: {exc}") from exc
    asyncio.run(serve_until_signalled(serve_gateway, config, args.nats))
    return 0


def _key_value(option: str) -> tuple[str, str]:
    key, sep, value = option.partition("=")
    if not sep or not key:
        raise ConfigError(f"--engine-option {option!r}: expected KEY=VALUE")
    return key, value


def _model(args: argparse.Namespace) -> int:
    print(MODELS[args.name]())
    return 0


def _trajectory(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    run = args.run or config.run
    asyncio.run(
        serve_until_signalled(
            serve_trajectory, args.nats, run, config.provision, config.trajectory, args.metrics_port
        )
    )
    return 0


def _agents(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    run = args.run or config.run
    fields = config.agents.model_dump()
    if args.agent:
        fields.update(agent=args.agent, command=None)
    if args.agent_command:
        fields.update(agent=None, command=shlex.split(args.agent_command))
    try:
        agents = AgentsConfig.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(f"agents settings: {exc}") from exc
    asyncio.run(
        serve_until_signalled(
            serve_agents, args.nats, run, config.provision, agents, args.gateway, args.metrics_port
        )
    )
    return 0


def _trainer(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    run = args.run or config.run
    trainer = config.trainer
    if args.world_size is not None:
        try:
            trainer = TrainerConfig.model_validate(
                {**trainer.model_dump(), "world_size": args.world_size}
            )
        except ValidationError as exc:
            raise ConfigError(f"trainer settings: {exc}") from exc
    model = resolve_model(args.model)
    asyncio.run(
        serve_until_signalled(
            serve_trainer, args.nats, run, config.provision, trainer, model, args.metrics_port
        )
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.run:
        config = config.model_copy(update={"run": args.run})
    asyncio.run(run_rl(config, args.config, args.nats))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "broker": _broker,
    "provision": lambda args: asyncio.run(_provision(args)),
    "status": lambda args: asyncio.run(_status(args)),
    "submit": _submit,
    "schema": _schema,
    "worker": _worker,
    "gateway": _gateway,
    "model": _model,
    "trajectory": _trajectory,
    "agents": _agents,
    "trainer": _trainer,
    "run": _run,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except SeamlessFlowError as exc:
        print(f"seamlessflow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
