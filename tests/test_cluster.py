"""The cluster suite (marker ``cluster``: ``make test-cluster``, root only): SeamlessFlow across
nodes on this machine (``tests.nodes``: network, UTS and mount namespaces joined by a bridge).

- The nodes are apart: hostnames, ``host_id``, ``/dev/shm`` and state folders are their own, they
  reach each other by address, and a node whose link is down is unreachable until it is back up.
- A first run across nodes: a 3-server NATS cluster (one server per node, routes between node
  addresses), a run provisioned with 3 replicas, a trainer on a 4th node with a rollout worker
  beside it and one on a 5th. The trainer's version reaches the worker beside it through the
  host-local copy (``path=local``) and the other through the object store (``path=store``).
  (Cut links, a NATS server's node among them, and a node joining mid-run:
  ``tests/test_slurm_cluster.py``.)
- A trainer group across nodes: two workers tagged train (no engine) on two nodes, placed by a
  scheduler on a third, form one group by rendezvous at rank 0's node and train every step
  together. It needs the nodes' names to resolve to their addresses (``tests.nodes`` gives
  them a hosts file, as a cluster's DNS would): without it gloo falls back to loopback and the
  other member cannot reach rank 0's store.
"""

import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import tomli_w
from nats.js.errors import KeyNotFoundError

from broker import codec
from broker.client import session
from broker.control import TrainerGroup
from broker.messages import WeightsPublished
from broker.subjects import RunNames
from tests.node_services import PY, Service, jetstream_ready, start_nats
from tests.nodes import STATE_IN_NODE, Cluster, Node, available
from tests.support import eventually, metric, registered
from tests.test_trainer import group, publish
from trainer import checkpoint

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

RUN = "nodes"
SMALL_STREAM = {"max_bytes": 4 << 20, "max_age_s": 3600.0}


def test_nodes_are_apart(tmp_path):
    with Cluster(2, tmp_path / "nodes") as cluster:
        a, b = cluster
        probe = (
            "import socket; from broker.weights import host_id; "
            "from common.paths import default_state_dir; "
            "print(socket.gethostname(), host_id(), default_state_dir())"
        )
        seen = [node.exec([PY, "-c", probe]).split() for node in cluster]
        assert [s[0] for s in seen] == [a.hostname, b.hostname]
        assert seen[0][1] != seen[1][1] and seen[0][1].startswith(f"{a.hostname}/")
        assert seen[0][2] == seen[1][2] == str(STATE_IN_NODE / "seamlessflow")
        a.exec(
            ["sh", "-c", f"touch /dev/shm/mine && mkdir -p {seen[0][2]} && touch {seen[0][2]}/x"]
        )
        assert (a.state_dir / "seamlessflow" / "x").exists()  # what the node wrote is its own
        listing = b.exec(["sh", "-c", f"ls -A /dev/shm {STATE_IN_NODE} {cluster.base}"])
        assert "mine" not in listing and "seamlessflow" not in listing and "sfn" not in listing
        assert not Path("/dev/shm/mine").exists()
        server = b.run([PY, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        hello = f"import socket; socket.create_connection(('{b.address}', 7000), 2).send(b'hi')"
        a.exec([PY, "-c", hello])
        assert server.wait(10) == 0 and server.stdout.read().strip() == "b'hi'"
        b.link_down()
        with pytest.raises(RuntimeError, match="timed out"):
            b.exec([PY, "-c", f"import socket; socket.create_connection(('{a.address}', 1), 1)"])
        b.link_up()
        refused = f"import socket; socket.create_connection(('{a.address}', 1), 5)"
        with pytest.raises(RuntimeError, match="ConnectionRefused"):  # back: a answers
            b.exec([PY, "-c", refused])


_ECHO = (
    "import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); "
    "print('listening', flush=True); c, _ = s.accept(); print(c.recv(8))"
)


def _run_config(path: Path, replicas: int = 3, **trainer: object) -> Path:
    config = {
        "model": {"max_model_len": 256},
        "provision": {
            "replicas": replicas,
            "weights_store_max_bytes": 48 << 20,
            **{p: SMALL_STREAM for p in ("tasks", "gen", "traj", "samples", "weights", "dead")},
        },
        "trainer": {
            "groups_per_step": 1,
            "lr": 1e-3,
            "max_staleness": 1000,
            "worker_id": "tr",
            **trainer,
        },
    }
    path.write_text(tomli_w.dumps(config))
    return path


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
async def test_weights_go_local_beside_the_trainer_and_through_the_store_elsewhere(
    nats_binary, tiny_model_dir, tmp_path
):
    with Cluster(5, tmp_path / "nodes") as cluster:
        servers, remote, home = cluster.nodes[:3], cluster[3], cluster[4]
        url = start_nats(servers, nats_binary)
        await jetstream_ready(url, servers)
        config = _run_config(tmp_path / "run.toml")
        remote.exec([PY, "-m", "seamlessflow.cli", "provision", "--nats", url, "--run", RUN,
                     "--config", str(config)])  # fmt: skip
        args = (
            "--nats",
            url,
            "--run",
            RUN,
            "--config",
            str(config),
            "--model",
            str(tiny_model_dir),
        )
        services = [
            Service(home, "trainer", "trainer", *args),
            Service(home, "w-local", "worker", *args, "--worker-id", "w-local"),
            Service(remote, "w-remote", "worker", *args, "--worker-id", "w-remote"),
        ]
        try:
            await _exchange_weights(url, cluster, services)
        except BaseException:
            print("\n".join(s.tail() for s in services))
            raise


async def _exchange_weights(url: str, cluster: Cluster, services: list[Service]) -> None:
    _, local, remote = services
    names = RunNames(RUN)
    async with session(url, "pytest-nodes") as nc:
        js = nc.jetstream()
        for s in services:
            await eventually(lambda s=s: _registered(js, names, s), timeout=150)
        hosts = {(await registered(js, names, w)).host for w in ("tr", "w-local", "w-remote")}
        assert hosts == {cluster[4].hostname, cluster[3].hostname}
        info = await js.stream_info(names.weights_stream)
        assert info.config.num_replicas == 3
        events: list[WeightsPublished] = []

        async def on_weights(msg) -> None:
            events.append(codec.decode(WeightsPublished, msg.data))

        await nc.subscribe(names.weights, cb=on_weights)
        await publish(js, names, *group("g1", 2))
        await eventually(lambda: _at(js, names, 1), timeout=90)
        # (logged after the registry entry is written; the core subscription may lag too)
        await eventually(lambda: local.loads() and remote.loads() and len(events) >= 2, timeout=10)
        boot = (cluster[4].folder / "boot_id").read_text().strip()
        # (a core subscription also sees a publish retried after a lost ack: JetStream's
        # de-duplication keeps it out of the stream only)
        announced = list(dict.fromkeys((e.version, e.host) for e in events))
        assert announced == [
            (1, f"{cluster[4].hostname}/{boot}"),
            (1, None),
        ]
        assert local.loads() == [(1, "local")], local.tail()
        assert remote.loads() == [(1, "store")], remote.tail()
        assert all(s.proc.poll() is None for s in services)


async def _registered(js, names: RunNames, service: Service) -> bool:
    assert service.proc.poll() is None, f"{service.name} exited\n{service.tail()}"
    worker_id = "tr" if service.name == "trainer" else service.name
    return await registered(js, names, worker_id) is not None


async def _at(js, names: RunNames, version: int) -> bool:
    """Every worker's registry entry says ``version``."""
    entries = [await registered(js, names, w) for w in ("tr", "w-local", "w-remote")]
    return all(e is not None and e.version == version for e in entries)


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
async def test_a_trainer_group_spans_nodes(nats_binary, tiny_model_dir, tmp_path):
    """Two workers tagged train (no engine) on two nodes form one trainer group: rank 0's
    rendezvous store is reached at its node, the ranks' gloo group runs between the nodes'
    addresses, and both train each step (the follower its shard), checkpoints in one folder
    both nodes see."""
    with Cluster(3, tmp_path / "nodes") as cluster:
        server, a, b = cluster
        url = start_nats([server], nats_binary)
        await jetstream_ready(url, [server])
        config = _run_config(tmp_path / "run.toml", replicas=1, checkpoint_every=1)
        ckpt = tmp_path / "checkpoints"  # outside the nodes' hidden folder: both see it
        args = ("--nats", url, "--run", RUN, "--config", str(config))
        server.exec([PY, "-m", "seamlessflow.cli", "provision", *args])
        member = ("worker", *args, "--model", str(tiny_model_dir), "--checkpoint-dir", str(ckpt))
        member = (*member, "--tags", "train", "--role", "train", "--worker-id")
        reachable = {"SEAMLESSFLOW_METRICS_HOST": "0.0.0.0"}  # /metrics from this machine
        scheduler = ("scheduler", *args, "--train-count", "2", "--rollout-count", "0")
        services = [
            Service(server, "scheduler", *scheduler),
            Service(a, "ta", *member, "ta", env=reachable),
            Service(b, "tb", *member, "tb", env=reachable),
        ]
        try:
            await _train_as_a_group(url, services, {"ta": a, "tb": b}, ckpt)
        except BaseException:
            print("\n".join(s.tail() for s in services))
            raise


async def _train_as_a_group(
    url: str, services: list[Service], nodes: dict[str, Node], ckpt: Path
) -> None:
    names = RunNames(RUN)
    async with session(url, "pytest-nodes") as nc:
        js = nc.jetstream()
        state = await js.key_value(names.state_kv)

        async def formed() -> bool:
            assert all(s.proc.poll() is None for s in services), "a part exited"
            try:
                entry = await state.get(RunNames.TRAINER_GROUP_KEY)
            except KeyNotFoundError:
                return False
            return sorted(codec.decode(TrainerGroup, entry.value).members) == sorted(nodes)

        await eventually(formed, timeout=150)
        await publish(js, names, *[s for i in range(4) for s in group(f"g{i}", 2, base=i)])
        await eventually(lambda: len(checkpoint.read_steps(ckpt)) >= 2, timeout=120)
        urls = {}
        for worker_id, node in nodes.items():
            port = urlparse((await registered(js, names, worker_id)).metrics_url).port
            urls[worker_id] = f"http://{node.address}:{port}/metrics"
        ranks = {w: await metric(u, "sf_trainer_group_rank") for w, u in urls.items()}
        assert sorted(ranks.values()) == [0, 1], ranks
        leader, follower = sorted(urls, key=ranks.__getitem__)
        assert await metric(urls[leader], "sf_trainer_group_size") == 2
        assert await metric(urls[follower], "sf_trainer_rank_step_seconds_count") >= 2
