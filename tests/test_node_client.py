"""A non-Python client (Node.js, npm ``nats``) submits tasks; the Python ingress validates them."""

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from broker.ingress import tasks_ingress
from broker.messages import MessageRejected, TaskSubmitted
from broker.permissions import Principal
from broker.subjects import Durable
from tests.support import SMALL_RUN, eventually, stream_messages

CLIENT_DIR = Path(__file__).parent / "clients" / "node"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (CLIENT_DIR / "node_modules" / "nats").is_dir(),
    reason="needs Node.js and `npm ci --prefix tests/clients/node` (make test does both)",
)


async def _node(url: str, subject: str, task: dict, *identity: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(CLIENT_DIR / "submit_task.mjs"),
        url,
        subject,
        json.dumps(task),
        *identity,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def _node_submit(url: str, subject: str, task: dict, *identity: str) -> dict:
    code, out, err = await _node(url, subject, task, *identity)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def client(broker, names) -> str:
    """The run's ``client`` identity file, what a submitting program is given."""
    return str(broker.authority.path(names.run, Principal.CLIENT))


async def test_node_client_connects_with_an_issued_identity(broker, names, client):
    """On a secured broker the Node client submits with the run's ``client`` identity; without
    one it is refused, and the ``client`` identity may not publish anything but tasks."""
    task = {"task_id": "n1", "messages": [{"role": "user", "content": "1+1"}]}
    ack = await _node_submit(broker.url, names.tasks, task, client)
    assert ack == {"stream": names.tasks_stream, "seq": 1, "duplicate": False}
    code, _, err = await _node(broker.url, names.tasks, task)
    assert code != 0 and "authorization" in err.lower()
    code, _, err = await _node(broker.url, names.samples, task, client)
    assert code != 0  # the client may not publish samples: no PubAck ever comes


async def test_node_client_task_is_received_and_validated(broker, js, names, client):
    task = {
        "task_id": "from-node-1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "7*6?"},
        ],
        "env": "arith",
        "reward": {"verifier": "exact_match", "reference": "42"},
        "group_size": 4,
        "metadata": {"lang": "javascript"},
    }
    ack = await _node_submit(broker.url, names.tasks, task, client)
    assert ack == {"stream": names.tasks_stream, "seq": 1, "duplicate": False}
    # Same task id again: JetStream de-duplicates it.
    again = await _node_submit(broker.url, names.tasks, task, client)
    assert again["duplicate"] is True
    # A malformed task from the same client is dead-lettered, not fatal.
    bad = {"task_id": "from-node-2", "messages": "7*6?"}
    await _node_submit(broker.url, names.tasks, bad, client)

    received: list[TaskSubmitted] = []

    async def handle(t: TaskSubmitted, _delivery) -> None:
        received.append(t)

    ingress = tasks_ingress(
        js, names, handle, SMALL_RUN.tasks, fetch_timeout=0.2, durable=Durable.SCHEDULER
    )
    stop = asyncio.Event()
    run = asyncio.create_task(ingress.run(stop))

    async def queue_empty() -> bool:
        return (await js.stream_info(names.tasks_stream)).state.messages == 0

    await eventually(queue_empty, watch=run)
    stop.set()
    await run

    assert received == [TaskSubmitted.model_validate(task)]
    assert received[0].reward.reference == "42" and received[0].group_size == 4
    (letter,) = await stream_messages(js, names.dead_stream, MessageRejected)
    assert letter.content_type == "application/json"
    assert "messages: Input should be a valid array" in letter.reason
    assert json.loads(letter.payload) == bad
