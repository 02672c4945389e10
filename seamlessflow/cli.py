"""``seamlessflow``: the command line. Each subcommand is a thin wrapper over a library call.

A subcommand imports what it runs only when it runs, so the base install (no torch) runs
``broker``, ``provision``, ``status``, ``submit``, ``dead-letters`` and ``schema export``
(``export`` too, with the ``export`` extra's pyarrow). The settings of the service subcommands
are flags generated from the run config's sections (``seamlessflow.flags``): a flag overrides
its key of the ``--config`` file.
"""

import argparse
import asyncio
import faulthandler
import json
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from broker.permissions import Principal
from common.exceptions import SeamlessFlowError
from common.log import setup_logging
from common.models import MODELS  # cheap: torch is imported inside its functions
from common.ready import claim_handshake
from emulation import plan
from rollout.gateway.config import ToolSettings
from seamlessflow import services
from seamlessflow.config import DEFAULT_RUN, load_config, override, read_table
from seamlessflow.exceptions import InputError
from seamlessflow.flags import Flag, add_flags, apply_flags, section_flags


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


def _add_config(p: argparse.ArgumentParser, sections: str) -> None:
    p.add_argument("--config", type=Path, help=f"TOML run config (its {sections})")


def _add_service(p: argparse.ArgumentParser, flags: list[Flag], *, metrics: bool = True) -> None:
    """The settings flags of a service subcommand, and its /metrics port."""
    add_flags(p, flags)
    p.set_defaults(flags=flags)
    if metrics:
        p.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seamlessflow", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("SEAMLESSFLOW_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tools(sub)
    for name, help_text, sections, flags, metrics in _services():
        p = sub.add_parser(name, help=help_text)
        _add_nats(p)
        _add_run(p)
        _add_config(p, sections)
        _add_service(p, flags, metrics=metrics)
    p = sub.add_parser(
        "run", help="run the whole RL loop on this machine (embedded broker by default)"
    )
    p.add_argument("config", nargs="?", type=Path, help="TOML run config (default: quickstart)")
    _add_nats(p, embedded=True)
    _add_run(p)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="embedded broker without authorization (anyone who reaches it may do anything): a "
        "throwaway local run only ([broker] insecure)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="embedded broker speaking TLS with a throwaway CA ([broker] tls_generate)",
    )
    return parser


def _add_tools(sub) -> None:
    """The commands that run once and exit (and the embedded broker)."""
    p = sub.add_parser("broker", help="run the embedded NATS JetStream broker until Ctrl-C")
    _add_config(p, "[broker] section")
    _add_service(p, section_flags("broker"), metrics=False)
    p = sub.add_parser(
        "creds",
        help="issue a run's broker identities (files mode 0600) for processes on other nodes or "
        "clients in other languages; a running `seamlessflow broker` applies them",
    )
    _add_run(p)
    p.add_argument(
        "--principal",
        action="append",
        choices=[x.value for x in Principal],
        help="whose identity (repeatable; default: every principal of the run)",
    )
    p.add_argument(
        "--valid-for",
        metavar="DURATION",
        help="issue new identities (new keys: the ones they replace are refused from the "
        "broker's next reload) that the broker refuses after DURATION (90s, 30m, 12h, 7d); "
        "default: keep an existing identity, a new one never expires",
    )
    _add_config(p, "[broker] section: its state_dir")
    p.add_argument("--state-dir", type=Path, help="the broker's folder (default: the config's)")
    p.add_argument(
        "--accounts",
        type=Path,
        metavar="FILE",
        help="also write the nats-server `accounts` block of every run in the state dir to FILE "
        "(`accounts: <JSON>`, public keys only), for a server config of your own to `include`",
    )
    p.add_argument(
        "--routes",
        type=Path,
        metavar="FILE",
        help="also write a NATS route cluster's credentials to FILE (mode 0600), for the "
        "servers' `cluster` block to `include`: a fresh random secret a server must present to "
        "join, and the routes (--route) that present it",
    )
    p.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a server's route address (repeatable), for --routes",
    )
    p.add_argument(
        "--gateway-keys",
        type=Path,
        metavar="DIR",
        help="also write fresh gateway keys to DIR (mode 0600): gateway_keys.toml (the "
        "gateway's --keys-file), agents.key (the agents' --gateway-key-file), metrics.key (a "
        "Prometheus credentials_file); it and --routes without --principal or --accounts: "
        "only what they write",
    )
    p = sub.add_parser("provision", help="create a run's streams, consumers and buckets")
    _add_nats(p)
    _add_run(p)
    _add_config(p, "[provision] section")
    p = sub.add_parser(
        "status", help="show a run's streams and consumers, its workers and its scheduler"
    )
    _add_nats(p)
    _add_run(p)
    p = sub.add_parser("submit", help="publish tasks from a JSONL file ('-' for stdin)")
    _add_nats(p)
    _add_run(p)
    p.add_argument("tasks", help="JSONL file, one TaskSubmitted per line")
    p = sub.add_parser("dead-letters", help="list a run's dead letters with their payloads")
    _add_nats(p)
    _add_run(p)
    p.add_argument("--source", help="only those of this ingress (e.g. 'tasks')")
    p.add_argument("--json", action="store_true", help="one JSON array instead of text")
    p = sub.add_parser("export", help="write a run's sessions, calls and samples as Parquet")
    _add_nats(p)
    _add_run(p)
    p.add_argument("out_dir", type=Path, help="folder for the .parquet files and export.json")
    p.add_argument("--since", help="only messages stored since: ISO 8601 time or e.g. 30m, 2h")
    p.add_argument("--follow", action="store_true", help="keep reading; rewrite every 30 s")
    p.add_argument("--tokenizer", help="model name or HF folder: add the calls' text columns")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser(
        "report", help="write a live run's summary.json and reward curve (as `run` does at its end)"
    )
    _add_nats(p)
    _add_run(p)
    _add_config(p, "run name and engine and trainer backend kinds")
    p.add_argument("out_dir", type=Path, help="folder for summary.json and reward_curve.png")
    p.add_argument("--targets", type=Path, required=True, help="the run's scrape_targets.json")
    p.add_argument("--started", type=float, required=True, help="when the run started (Unix time)")
    p.add_argument("--stopped-by", default="a report of the live run", help="why it ends now")
    p = sub.add_parser(
        "plan", help="recommend a layout, split and staleness from a run's summary (simulated)"
    )
    plan.add_arguments(p)
    p = sub.add_parser("schema", help="wire schemas")
    schema_sub = p.add_subparsers(dest="schema_command", required=True)
    e = schema_sub.add_parser("export", help="write a JSON Schema file per message")
    e.add_argument("dir", type=Path)
    p = sub.add_parser("model", help="build or unpack a model for CPU and print its folder")
    p.add_argument("name", choices=sorted(MODELS))
    p = sub.add_parser("slurm", help="render a run's sbatch script and submit it (or print it)")
    p.add_argument("config", nargs="?", type=Path, help="TOML run config (its [slurm] section)")
    _add_run(p)
    _add_service(p, section_flags("slurm"), metrics=False)
    p.add_argument("--dry-run", action="store_true", help="print the script, do not sbatch it")


def _services() -> list[tuple[str, str, str, list[Flag], bool]]:
    """The long-running parts (a declarative table): name, help, the config sections they read,
    their settings flags, and whether they serve /metrics on a port of their own."""
    model = partial(section_flags, "model")
    # No --temperature for trainer and agents: they must agree on it, so it is set in the file.
    return [
        (
            "worker",
            "run a rollout worker until Ctrl-C",
            "[model], [worker], [provision] and, tagged train, [trainer] sections",
            model(only=("name", "max_model_len"))
            + section_flags("worker")
            + section_flags("trainer", only=("checkpoint_dir", "threads")),  # tagged train
            True,
        ),
        (
            "gateway",
            "serve the OpenAI-compatible API until Ctrl-C",
            "[model] and [gateway] sections",
            model(only=("name", "served_name", "max_model_len", *ToolSettings.model_fields))
            + section_flags("gateway"),
            False,  # /metrics on its own port
        ),
        (
            "trajectory",
            "run the trajectory manager until Ctrl-C",
            "[trajectory], [rewards] and [provision] sections",
            section_flags("trajectory") + section_flags("rewards"),
            True,
        ),
        (
            "agents",
            "run agents on a run's tasks against a gateway until Ctrl-C",
            "[agents], [rewards] and [provision] sections",
            section_flags("agents", skip=("temperature",)) + section_flags("rewards"),
            True,
        ),
        (
            "trainer",
            "run the trainer (all its ranks) until Ctrl-C",
            "[model], [trainer] and [provision] sections",
            model(only=("name",)) + section_flags("trainer", skip=("temperature",)),
            True,
        ),
        (
            "scheduler",
            "run the tag scheduler (one leads per run) until Ctrl-C",
            "[scheduler], [layout], [trainer] and [provision] sections",
            section_flags("scheduler") + section_flags("layout"),
            True,
        ),
    ]


def _creds(args: argparse.Namespace) -> int:
    from seamlessflow.creds import creds

    return creds(args)


async def _provision(args: argparse.Namespace) -> int:
    from broker.client import session
    from broker.provision import provision_run

    config = load_config(args.config)
    run = args.run or config.run
    async with session(args.nats, "seamlessflow-provision", principal=Principal.ADMIN) as nc:
        report = await provision_run(nc.jetstream(), run, config.provision)
    print(f"run {run!r}: {len(report.created)} created, {len(report.unchanged)} unchanged")
    for name in report.created:
        print(f"  created {name}")
    return 0


async def _status(args: argparse.Namespace) -> int:
    from broker.client import session
    from broker.provision import run_status
    from broker.registry import read_registry
    from broker.subjects import RunNames
    from seamlessflow.launcher import (
        print_status,
        print_workers,
        read_control,
        scrape_role_seconds,
    )
    from tagsched.lease import lease_holder

    async with session(args.nats, "seamlessflow-status", principal=Principal.OBSERVER) as nc:
        js = nc.jetstream()
        run = args.run or DEFAULT_RUN
        status = await run_status(js, run)
        if not status.missing:
            names = RunNames(run)
            workers = await read_registry(js, names)  # dated by the server's clock alone
            ttl = (await (await js.key_value(names.workers_kv)).status()).ttl
            leader = await lease_holder(js, names)
            seconds = await scrape_role_seconds(workers)
            control = await read_control(js, names)
    print_status(status)
    if not status.missing:
        print_workers(workers, leader, ttl=ttl, role_seconds=seconds, control=control)
    return 1 if status.missing else 0


def _submit(args: argparse.Namespace) -> int:
    from broker.client import session
    from broker.subjects import RunNames
    from seamlessflow.submit import parse_tasks, submit_tasks

    if args.tasks == "-":
        tasks, errors = parse_tasks(sys.stdin, "<stdin>")
    else:
        try:
            with open(args.tasks) as f:
                tasks, errors = parse_tasks(f, args.tasks)
        except OSError as exc:
            raise InputError(f"cannot read {args.tasks}: {exc}") from exc
    for error in errors:
        print(error, file=sys.stderr)
    names = RunNames(args.run or DEFAULT_RUN)

    async def publish():
        async with session(args.nats, "seamlessflow-submit", principal=Principal.CLIENT) as nc:
            return await submit_tasks(nc.jetstream(), names, tasks)

    report = asyncio.run(publish())
    print(
        f"submitted {report.published} tasks to {names.tasks} "
        f"({report.duplicates} duplicates, {len(errors)} invalid)"
    )
    return 1 if errors else 0


async def _dead_letters(args: argparse.Namespace) -> int:
    from broker.client import session
    from broker.deadletters import read_dead_letters
    from broker.subjects import RunNames

    names = RunNames(args.run or DEFAULT_RUN)
    async with session(args.nats, "seamlessflow-dead-letters", principal=Principal.OBSERVER) as nc:
        letters = await read_dead_letters(nc.jetstream(), names, args.source)
    if args.json:
        print(json.dumps([letter.as_dict() for letter in letters], indent=2))
        return 0
    for letter in letters:
        cut = f", first {letter.payload_size} bytes" if letter.truncated else ""
        print(f"#{letter.seq} {letter.source} (stream seq {letter.stream_seq}): {letter.reason}")
        print(f"  subject {letter.original_subject}, {letter.payload_size} bytes{cut}")
        print(f"  payload ({letter.payload_encoding}): {json.dumps(letter.payload)}")
    print(f"{len(letters)} dead letters on {names.dead_stream}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from seamlessflow.export import ExportRequest, export_run, parse_since

    request = ExportRequest(
        url=args.nats,
        run=args.run or DEFAULT_RUN,
        out_dir=args.out_dir,
        since=parse_since(args.since) if args.since else None,
        follow=args.follow,
        tokenizer=args.tokenizer,
        progress=not args.no_progress,
    )
    try:
        collected = asyncio.run(export_run(request))
    except KeyboardInterrupt:  # --follow: the tables were written on the way out
        return 0
    rows = ", ".join(f"{n} {name}" for name, n in collected.counts().items())
    skipped = sum(collected.skipped.values())
    print(f"exported {rows} of run {request.run!r} to {args.out_dir} ({skipped} skipped)")
    return 0


def _report(args: argparse.Namespace) -> int:
    from seamlessflow.report import print_summary, report_run

    config = load_config(args.config)
    config = override(config, {"run": args.run}) if args.run else config
    try:
        targets = json.loads(args.targets.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the scrape targets {args.targets}: {exc}") from exc
    summary = asyncio.run(
        report_run(
            args.nats,
            config,
            targets,
            args.out_dir,
            started=args.started,
            stopped_by=args.stopped_by,
        )
    )
    print_summary(summary)
    return 0


def _schema(args: argparse.Namespace) -> int:
    from broker.schema import export_schemas

    for path in export_schemas(args.dir):
        print(path)
    return 0


def _model(args: argparse.Namespace) -> int:

    print(MODELS[args.name]())
    return 0


def _slurm(args: argparse.Namespace) -> int:
    from seamlessflow.slurm import render, submit

    table = read_table(args.config) if args.config else {}  # what every part is handed
    table.update({"run": args.run} if args.run else {})
    config = apply_flags(load_config(args.config), args, args.flags)
    config = override(config, {"run": args.run}) if args.run else config
    script = render(config, table, str(args.config or "the defaults"))
    if args.dry_run:
        print(script, end="")
        return 0
    job = submit(script, config.slurm.log_dir)
    print(f"submitted job {job}: logs in {config.slurm.log_dir.absolute()}/{job}/")
    return 0


def _run(args: argparse.Namespace) -> int:
    from seamlessflow.run import run_rl

    config = load_config(args.config)
    if args.run:
        config = override(config, {"run": args.run})
    if args.insecure:
        config = override(config, {"broker": {"insecure": True}})
    if args.tls:
        config = override(config, {"broker": {"tls_generate": True}})
    asyncio.run(run_rl(config, args.nats))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "broker": services.broker,
    "creds": _creds,
    "provision": lambda args: asyncio.run(_provision(args)),
    "status": lambda args: asyncio.run(_status(args)),
    "submit": _submit,
    "dead-letters": lambda args: asyncio.run(_dead_letters(args)),
    "export": _export,
    "report": _report,
    "plan": plan.main,
    "schema": _schema,
    "worker": services.worker,
    "gateway": services.gateway,
    "model": _model,
    "trajectory": services.trajectory,
    "agents": services.agents,
    "trainer": services.trainer,
    "scheduler": services.scheduler,
    "slurm": _slurm,
    "run": _run,
}


def main(argv: list[str] | None = None) -> int:
    claim_handshake()
    # SIGUSR1 prints every thread's stack: a launcher asks for it before killing a stuck child.
    # The process's own stderr (not a replacement of sys.stderr, as when called in-process).
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except SeamlessFlowError as exc:
        print(f"seamlessflow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
