"""The long-running parts' commands (``seamlessflow broker|worker|gateway|trajectory|agents|
trainer|scheduler``): each reads its sections of the run config (``--config`` with its flags
applied, validated as a whole) and serves its part until SIGINT/SIGTERM. Each imports what it
runs only when it runs."""

import argparse
import asyncio

from seamlessflow.config import RunConfig, load_config, override, read_table
from seamlessflow.exceptions import ConfigError
from seamlessflow.flags import apply_flags


def settings(args: argparse.Namespace) -> RunConfig:
    """The run config of ``--config`` (or the defaults), with the given flags and ``--run``."""
    config = apply_flags(load_config(args.config), args, args.flags)
    if getattr(args, "run", None):  # the broker serves every run: it has no --run
        config = override(config, {"run": args.run})
    return config


def broker(args: argparse.Namespace) -> int:
    from seamlessflow.launcher import serve_broker

    asyncio.run(serve_broker(settings(args).broker))
    return 0


def worker(args: argparse.Namespace) -> int:
    from common.models import resolve_model
    from rollout.engines import EngineConfig
    from seamlessflow.launcher import serve_until_signalled
    from tagsched.spec import has_tags

    config = settings(args)
    engine = EngineConfig(
        model=resolve_model(config.model.name),
        max_model_len=config.model.max_model_len,
        settings=config.worker.engine,
    )
    worker = config.worker
    if not has_tags(worker.tags, ["train"]):
        from rollout.serve import serve_worker

        asyncio.run(
            serve_until_signalled(
                serve_worker,
                args.nats,
                config.run,
                config.provision,
                engine,
                worker,
                args.metrics_port,
            )
        )
        return 0
    # A worker tagged train also holds a trainer ([trainer]; it registers as the worker).
    from colocate.worker import Colocated, serve_colocated

    colocated = Colocated(
        url=args.nats,
        run=config.run,
        provision=config.provision,
        engine=engine,
        worker=worker,
        trainer=config.trainer,
        metrics_port=args.metrics_port,
    )
    asyncio.run(serve_until_signalled(serve_colocated, colocated))
    return 0


def gateway(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from common.models import resolve_model
    from rollout.gateway import GatewayConfig, serve_gateway
    from rollout.gateway.config import ToolSettings
    from seamlessflow.launcher import serve_until_signalled

    config = settings(args)
    try:
        gateway = GatewayConfig(
            **config.gateway.model_dump(),
            model=config.model.served_name,
            model_path=resolve_model(config.model.name),
            run=config.run,
            max_model_len=config.model.max_model_len,
            **config.model.model_dump(include=set(ToolSettings.model_fields)),
        )
    except ValidationError as exc:
        raise ConfigError(f"gateway settings: {exc}") from exc
    asyncio.run(serve_until_signalled(serve_gateway, gateway, args.nats))
    return 0


def trajectory(args: argparse.Namespace) -> int:
    from seamlessflow.launcher import serve_until_signalled
    from trajectory.manager import serve_trajectory

    c = settings(args)
    asyncio.run(
        serve_until_signalled(
            serve_trajectory,
            args.nats,
            c.run,
            c.provision,
            c.trajectory,
            c.rewards,
            args.metrics_port,
        )
    )
    return 0


def agents(args: argparse.Namespace) -> int:
    from rollout.agents.runner import serve_agents
    from seamlessflow.launcher import serve_until_signalled

    c = settings(args)
    if c.agents.gateway is None:
        raise ConfigError("agents need the gateway's URL: --gateway or [agents] gateway")
    asyncio.run(
        serve_until_signalled(
            serve_agents,
            args.nats,
            c.run,
            c.provision,
            c.agents,
            c.rewards,
            c.agents.gateway,
            args.metrics_port,
        )
    )
    return 0


def trainer(args: argparse.Namespace) -> int:
    from common.models import resolve_model
    from seamlessflow.launcher import serve_until_signalled
    from trainer.serve import serve_trainer

    c = settings(args)
    model = resolve_model(c.model.name)
    asyncio.run(
        serve_until_signalled(
            serve_trainer, args.nats, c.run, c.provision, c.trainer, model, args.metrics_port
        )
    )
    return 0


def scheduler(args: argparse.Namespace) -> int:
    from seamlessflow.launcher import serve_until_signalled
    from tagsched.serve import serve_scheduler

    c = settings(args)
    # Only a config that sets [trainer] can disagree with the registered trainer's shape.
    configured = args.config is not None and "trainer" in read_table(args.config)
    asyncio.run(
        serve_until_signalled(
            serve_scheduler,
            args.nats,
            c.run,
            c.provision,
            c.scheduler,
            c.layout,
            c.trainer.shape() if configured else None,
            args.metrics_port,
        )
    )
    return 0
