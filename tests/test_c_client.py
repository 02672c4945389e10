"""A C client (nats.c, Debian's libnats-dev) submits a task with an issued identity; without one
it is refused."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from broker.permissions import Principal

SOURCE = Path(__file__).parent / "clients" / "c" / "submit_task.c"

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not Path("/usr/include/nats/nats.h").is_file(),
    reason="needs a C compiler and nats.c (`apt-get install libnats-dev`; .ci/run does)",
)


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("c") / "submit_task"
    subprocess.run(["cc", "-O1", "-o", str(binary), str(SOURCE), "-lnats"], check=True)
    return binary


def _submit(binary: Path, url: str, subject: str, task: dict, *identity: Path):
    return subprocess.run(
        [str(binary), url, subject, json.dumps(task), *map(str, identity)],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_c_client_connects_with_an_issued_identity(c_client, broker, names):
    client = broker.authority.path(names.run, Principal.CLIENT)
    task = {"task_id": "c1", "messages": [{"role": "user", "content": "1+1"}]}
    done = _submit(c_client, broker.url, names.tasks, task, client)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"stream": names.tasks_stream, "seq": 1, "duplicate": False}
    anonymous = _submit(c_client, broker.url, names.tasks, task)
    assert anonymous.returncode == 1 and "Authorization Violation" in anonymous.stderr
    forged = _submit(c_client, broker.url, names.samples, task, client)
    assert forged.returncode == 1  # the client may not publish samples: no ack ever comes
