"""The command line, run as a user runs it: a subprocess against a real broker."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from broker.messages import TaskSubmitted
from broker.subjects import RunNames
from tests.support import stream_messages

SMALL_TOML = 'run = "{run}"\n[provision]\nweights_store_max_bytes = 8388608\n' + "".join(
    f"[provision.{stream}]\nmax_bytes = 4194304\n"
    for stream in ("tasks", "gen", "traj", "samples", "weights", "dead")
)


def sf(
    *args: str, stdin: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _config(tmp_path: Path, run: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(SMALL_TOML.format(run=run))
    return path


async def test_provision_then_submit_then_status(broker, js, run_name, tmp_path):
    config = _config(tmp_path, run_name)
    done = sf("provision", "--nats", broker.url, "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert f"run '{run_name}': 12 created" in done.stdout

    lines = [
        json.dumps({"task_id": "a", "messages": [{"role": "user", "content": "1+1"}]}),
        "",
        json.dumps({"task_id": "b", "messages": [{"role": "user", "content": "2+2"}]}),
        json.dumps({"task_id": "c", "messages": "3+3"}),
        json.dumps({"task_id": "a", "messages": [{"role": "user", "content": "1+1"}]}),
        "not json at all",
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    done = sf("submit", "--nats", broker.url, "--run", run_name, str(tasks))
    assert done.returncode == 1  # some lines were invalid
    assert f"submitted 2 tasks to sf.{run_name}.tasks (1 duplicates, 2 invalid)" in done.stdout
    assert (
        f"{tasks}:4: invalid TaskSubmitted: messages: Input should be a valid array" in done.stderr
    )
    assert f"{tasks}:6: invalid TaskSubmitted: <message>: Invalid JSON" in done.stderr

    names = RunNames(run_name)
    stored = await stream_messages(js, names.tasks_stream, TaskSubmitted)
    assert [t.task_id for t in stored] == ["a", "b"]

    done = sf("status", "--nats", broker.url, "--run", run_name)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith(names.tasks_stream))
    assert row.split()[1] == "2"

    # The same file's config again is a no-op; a different one is refused, with exit code 2.
    assert (
        "0 created, 12 unchanged"
        in sf("provision", "--nats", broker.url, "--config", str(config)).stdout
    )
    clash = config.read_text().replace("[provision]\n", "[provision]\nworkers_ttl_s = 5.0\n")
    config.write_text(clash)
    done = sf("provision", "--nats", broker.url, "--config", str(config))
    assert done.returncode == 2
    assert "exists as 30.0, config asks 5.0" in done.stderr
    assert "Traceback" not in done.stderr


def test_submit_reads_stdin_and_status_flags_a_missing_run(broker, run_name):
    task = json.dumps({"task_id": "x", "messages": [{"role": "user", "content": "hi"}]})
    done = sf("submit", "--nats", broker.url, "--run", run_name, "-", stdin=task + "\n")
    # The run was never provisioned: a clear error, not a traceback.
    assert done.returncode == 2
    assert f"run '{run_name}' is not provisioned" in done.stderr
    assert "Traceback" not in done.stderr
    done = sf("status", "--nats", broker.url, "--run", run_name)
    assert done.returncode == 1
    assert f"missing: SF_{run_name}_TASKS" in done.stdout


def test_unreachable_nats_is_one_line_error():
    done = sf("status", "--nats", "nats://127.0.0.1:1", "--run", "x")
    assert done.returncode == 2
    assert "cannot reach NATS at nats://127.0.0.1:1" in done.stderr
    assert "Traceback" not in done.stderr


def test_schema_export_cli(tmp_path):
    done = sf("schema", "export", str(tmp_path / "schemas"))
    assert done.returncode == 0, done.stderr
    written = sorted(p.name for p in (tmp_path / "schemas").iterdir())
    assert "TaskSubmitted.json" in written and "WeightsPublished.json" in written
    schema = json.loads((tmp_path / "schemas" / "TaskSubmitted.json").read_text())
    assert schema["required"] == ["task_id", "messages"]


@pytest.mark.newest_nats
async def test_gateway_and_model_commands(broker, names, tmp_path):
    env = {**os.environ, "SEAMLESSFLOW_MODELS": str(tmp_path / "models"), "HF_HUB_OFFLINE": "1"}
    built = sf("model", "tiny", env=env)
    assert built.returncode == 0, built.stderr
    model = Path(built.stdout.strip())
    assert model == tmp_path / "models" / "tiny-llama" and (model / "config.json").is_file()

    bad = sf("gateway", "--nats", broker.url, "--run", names.run, "--model", str(tmp_path))
    assert bad.returncode == 2 and "neither one of tiny, smollm2 nor an HF folder" in bad.stderr

    args = ["--nats", broker.url, "--run", names.run, "--model", "tiny", "--port", "0"]
    args += ["--served-model-name", "policy"]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "seamlessflow.cli", "gateway", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = await asyncio.to_thread(gateway.stdout.readline)
        while line and "gateway ready:" not in line:
            line = await asyncio.to_thread(gateway.stdout.readline)
        assert f"model=policy run={names.run}" in line, line
        url = line.split("url=", 1)[1].split()[0]
        async with httpx.AsyncClient(timeout=10) as http:
            models = (await http.get(f"{url}/models")).json()
        assert [m["id"] for m in models["data"]] == ["policy"]
    finally:
        gateway.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gateway.wait, 30) == 0
