"""SeamlessFlow on the namespace nodes of ``tests.nodes``, for the cluster tests and
``bench/cluster.py``: NATS servers with JetStream (one per node, a route cluster when there are
several) and ``seamlessflow`` parts started in a node with their output kept."""

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from nats.errors import Error as NatsError

from broker.client import session
from tests.nodes import STATE_IN_NODE, Node

NATS_PORT, ROUTE_PORT = 4222, 6222
PING_S = 2
"""A client cut off is dropped after about ``PING_S * 3`` (nats-server's default: 4 min)."""
LOADED = re.compile(
    r"weights_loaded version=(\d+) seconds=([\d.]+) fetch_seconds=([\d.]+) path=(\w+)"
)
PY = sys.executable


class Load(NamedTuple):
    """One weight load, as a worker logged it."""

    version: int
    path: str  # local | store
    seconds: float  # fetch + load
    fetch_seconds: float


class Service:
    """``seamlessflow <args>`` in a node, its output kept (one torch thread, offline)."""

    def __init__(self, node: Node, name: str, *args: str, env: dict[str, str] | None = None):
        self.name = name
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = node.run(
            [PY, "-m", "seamlessflow.cli", *args],
            env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def weight_loads(self) -> list[Load]:
        """Each weight load so far."""
        found = (LOADED.search(line) for line in list(self.lines))
        return [Load(int(m[1]), m[4], float(m[2]), float(m[3])) for m in found if m]

    def loads(self) -> list[tuple[int, str]]:
        """(version, path) of each weight load so far."""
        return [(load.version, load.path) for load in self.weight_loads()]

    def tail(self, n: int = 40) -> str:
        return f"--- {self.name} ---\n" + "".join(self.lines[-n:])


def start_nats(nodes: list[Node], binary: Path) -> str:
    """One nats-server with JetStream per node, routed to the others when there are several;
    returns the client URL."""
    routes = [f"nats-route://{node.address}:{ROUTE_PORT}" for node in nodes]
    for node in nodes:
        conf = {
            "server_name": node.hostname,
            "listen": f"0.0.0.0:{NATS_PORT}",
            "max_payload": 2 << 20,
            "ping_interval": f"{PING_S}s",
            "ping_max": 2,
            "jetstream": {"store_dir": str(STATE_IN_NODE / "nats" / "jetstream")},
        }
        if len(nodes) > 1:
            conf["cluster"] = {
                "name": "sf-nodes",
                "listen": f"0.0.0.0:{ROUTE_PORT}",
                "routes": routes,
            }
        (node.state_dir / "nats.conf").write_text(json.dumps(conf))
        log = (node.state_dir / "nats.log").open("ab")
        node.run([binary, "-c", STATE_IN_NODE / "nats.conf"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
    return ",".join(f"nats://{node.address}:{NATS_PORT}" for node in nodes)


async def jetstream_ready(url: str, nodes: list[Node], timeout: float = 60.0) -> None:
    """Until the servers have a JetStream meta leader (account info answers)."""
    deadline = time.monotonic() + timeout
    async with session(url, "sf-nodes-probe", give_up_after=timeout) as nc:
        while True:
            try:
                await nc.jetstream().account_info()
                return
            except NatsError:
                if time.monotonic() > deadline:
                    logs = [(n.state_dir / "nats.log").read_text()[-2000:] for n in nodes]
                    raise AssertionError("no JetStream meta leader:\n" + "\n".join(logs)) from None
                await asyncio.sleep(0.2)
