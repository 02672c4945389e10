"""The command line, run as a user runs it: a subprocess against a real broker."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest

from broker import codec
from broker.control import Fence, SchedulerState, TrainerGroup
from broker.ingress import tasks_ingress
from broker.messages import Role, TaskSubmitted
from broker.registry import Registration, node_name
from broker.subjects import Durable, RunNames
from rollout.engines import HFEngineConfig, VLLMEngineConfig
from seamlessflow import services
from seamlessflow.cli import build_parser
from tests.support import SMALL_RUN, eventually, status_workers, stream_messages
from trainer.config import MegatronBackendConfig

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
    assert f"run '{run_name}': 15 created" in done.stdout

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

    # a registered worker is listed with its node, the age of its entry and its clock; and, from
    # the state bucket, its role lease, fence and trainer group rank (here as the scheduler and
    # the group record would have them: w-1 a group member lent to rollout, then fenced)
    registration = await Registration.open(js, names, "w-1", tags=["rollout"], role=Role.IDLE)
    await registration.put()
    other = await Registration.open(js, names, "w-2", tags=["train"], role=Role.TRAIN)
    await other.put()
    state = await js.key_value(names.state_kv)
    group = TrainerGroup(generation=3, members=["w-2", "w-1"], changed_at=time.time())
    await state.put(RunNames.TRAINER_GROUP_KEY, codec.encode(group))

    def status() -> dict[str, dict[str, str]]:
        done = sf("status", "--nats", broker.url, "--run", run_name)
        assert done.returncode == 0, done.stderr
        row = next(x for x in done.stdout.splitlines() if x.startswith(names.tasks_stream))
        assert row.split()[1] == "2"
        rows = status_workers(done.stdout)
        for r in rows.values():
            age, ago = r["written"].split()
            assert ago == "ago" and float(age.rstrip("s")) < 30 and r["clock"] == "ok"
        return rows

    rows = status()
    assert list(rows["w-1"])[:7] == ["worker", "node", "tags", "role", "epoch", "version", "busy"]
    w1 = rows["w-1"]
    assert w1["node"] == node_name() and w1["tags"] == f"rollout,node={node_name()}"
    assert w1["role"] == "idle" and w1["lease"] == "-" and w1["rank"] == "1"
    assert (w1["fenced"], w1["lent"]) == ("no", "no")
    assert rows["w-2"]["rank"] == "0" and rows["w-2"]["lent"] == "no"
    assert 0 < float(rows["w-2"]["lease"].rstrip("s")) <= 20  # 2/3 of the 30 s TTL
    await registration.put(role=Role.ROLLOUT, epoch=4)
    fence = Fence(worker_id="w-1", started_at=registration.entry.started_at, epoch=5)
    scheduler = SchedulerState(leader="s", epoch=5, fenced=[fence])
    await state.put(RunNames.SCHEDULER_STATE_KEY, codec.encode(scheduler))
    rows = status()
    w1 = rows["w-1"]
    assert (w1["role"], w1["fenced"], w1["lent"], w1["rank"]) == ("rollout", "yes", "yes", "1")
    assert rows["w-2"]["fenced"] == "no"

    # The same file's config again is a no-op; a different one is refused, with exit code 2.
    assert (
        "0 created, 15 unchanged"
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
    assert f"no stream SF_{run_name}_TASKS" in done.stderr
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


# -- dead letters ---------------------------------------------------------------------------


async def test_dead_letters_lists_real_dead_letters_with_decoded_payloads(broker, js, names):
    """Bad tasks go through a real ingress to the dead-letter stream; the command reads them
    back with their reasons and payloads decoded, never as Python reprs."""
    bad = [
        (b"\xc1\xc1", None),  # neither msgpack nor JSON
        (msgpack.packb({"task_id": "m", "messages": [], "group_size": "many"}), None),
        (json.dumps({"task_id": "j", "messages": "x"}).encode(), "application/json"),
        (json.dumps({"task_id": "h", "messages": []}).encode(), None),  # JSON, no header
        (msgpack.packb({"task_id": "b", "messages": [], "blob": b"\x00\xff"}), None),
    ]
    for payload, ctype in bad:
        headers = {"Content-Type": ctype} if ctype else None
        await js.publish(names.tasks, payload, headers=headers)

    async def refuse(task, delivery):
        raise AssertionError(f"no valid task was sent, got {task}")

    ingress = tasks_ingress(
        js, names, refuse, SMALL_RUN.tasks, fetch_timeout=0.2, durable=Durable.SCHEDULER
    )
    stop = asyncio.Event()
    running = asyncio.create_task(ingress.run(stop))

    async def all_dead() -> bool:
        return (await js.stream_info(names.dead_stream)).state.messages == len(bad)

    try:
        await eventually(all_dead, watch=running)
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)

    done = await asyncio.to_thread(
        sf, "dead-letters", "--nats", broker.url, "--run", names.run, "--json"
    )
    assert done.returncode == 0, done.stderr
    letters = json.loads(done.stdout)
    assert [letter["source"] for letter in letters] == ["tasks"] * len(bad)
    assert [letter["stream_seq"] for letter in letters] == [1, 2, 3, 4, 5]
    assert [letter["subject"] for letter in letters] == [names.dead("tasks")] * len(bad)
    raw, wrong_type, json_schema, json_no_header, nested = letters
    assert raw["payload_encoding"] == "base64" and raw["payload"] == "wcE="
    assert "not valid msgpack" in raw["reason"]
    assert wrong_type["payload_encoding"] == "msgpack"
    assert wrong_type["payload"] == {"task_id": "m", "messages": [], "group_size": "many"}
    assert "group_size" in wrong_type["reason"]
    assert json_schema["payload"] == {"task_id": "j", "messages": "x"}
    assert json_schema["content_type"] == "application/json"
    assert json_no_header["payload_encoding"] == "json"
    assert "JSON senders must set Content-Type" in json_no_header["reason"]
    assert nested["payload"]["blob"] == {"base64": "AP8="}
    assert all(
        letter["payload_size"] == len(p) and not letter["truncated"]
        for letter, (p, _) in zip(letters, bad, strict=True)
    )

    text = await asyncio.to_thread(sf, "dead-letters", "--nats", broker.url, "--run", names.run)
    assert text.returncode == 0, text.stderr
    assert 'payload (base64): "wcE="' in text.stdout
    assert '"group_size": "many"' in text.stdout
    assert f"5 dead letters on {names.dead_stream}" in text.stdout
    assert not re.search(r"\bb'|\\x[0-9a-f]{2}", text.stdout), text.stdout  # no bytes repr


def test_dead_letters_of_a_missing_run_is_one_line_error(broker, run_name):
    done = sf("dead-letters", "--nats", broker.url, "--run", run_name)
    assert done.returncode == 2
    assert (
        f"run '{run_name}' is not provisioned: no stream SF_{run_name}_DEAD "
        f"(run `seamlessflow provision --run {run_name}`)"
    ) in done.stderr
    assert "Traceback" not in done.stderr


# -- flags are config keys ------------------------------------------------------------------


def test_service_flags_override_config_keys_through_the_same_models(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[worker]\nmax_running = 4\nkeepalive_s = 2.5\n[worker.engine]\nkind = "vllm"\n'
        "max_num_seqs = 3\n[model]\nmax_model_len = 128\n"
    )
    argv = ["worker", "--nats", "x", "--config", str(config), "--max-running", "8"]
    args = build_parser().parse_args(
        [*argv, "--tags", "rollout,gpu=h200 node=a1", "--engine-max-num-seqs", "9"]
    )
    worker = services.settings(args).worker
    assert (worker.max_running, worker.keepalive_s, worker.tags) == (
        8,
        2.5,
        ["rollout", "gpu=h200", "node=a1"],
    )
    assert worker.engine == VLLMEngineConfig(max_num_seqs=9)
    assert services.settings(args).model.max_model_len == 128
    # Another kind drops the file's options of the old kind.
    args = build_parser().parse_args([*argv, "--engine", "hf"])
    assert services.settings(args).worker.engine == HFEngineConfig()
    args = build_parser().parse_args(["trainer", "--nats", "x", "--backend", "megatron"])
    assert services.settings(args).trainer.backend == MegatronBackendConfig()


def test_agent_and_command_flags_replace_each_other_from_the_config_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[agents]\nagent = "mod:fn"\n')
    base = ["agents", "--nats", "x", "--gateway", "http://g", "--config", str(config)]
    args = build_parser().parse_args([*base, "--command", "node agent.mjs --x a,b"])
    agents = services.settings(args).agents
    assert (agents.agent, agents.command) == (None, ["node", "agent.mjs", "--x", "a,b"])
    config.write_text('[agents]\ncommand = ["node", "agent.mjs"]\n')
    agents = services.settings(build_parser().parse_args([*base, "--agent", "pkg.m:f"])).agents
    assert (agents.agent, agents.command) == ("pkg.m:f", None)
    # Sampling temperature is set in the file only: trainer and agents must agree on it.
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--temperature", "0.7"])


def test_bad_flags_are_one_line_errors_naming_the_flag():
    done = sf("worker", "--nats", "nats://127.0.0.1:1", "--max-running", "0")
    assert done.returncode == 2, done.stderr
    assert "--max-running '0': Input should be greater than or equal to 1" in done.stderr
    done = sf("worker", "--nats", "nats://127.0.0.1:1", "--engine-kv-cache-memory-bytes", "5")
    assert done.returncode == 2, done.stderr
    assert "--engine-kv-cache-memory-bytes '5': Extra inputs are not permitted" in done.stderr
    done = sf("trainer", "--nats", "nats://127.0.0.1:1", "--backend", "megatron", "--device", "cpu")
    assert done.returncode == 2, done.stderr
    assert "trainer: Value error, the megatron backend runs on CUDA only" in done.stderr
    assert "Traceback" not in done.stderr
    done = sf("worker", "--nats", "x", "--engine", "sglang")
    assert done.returncode == 2 and "invalid choice: 'sglang'" in done.stderr


# -- the base install -----------------------------------------------------------------------

NO_TORCH = '''
import sys


class Absent:
    """Makes torch, transformers and vllm (and their submodules) look not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"torch", "transformers", "vllm"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


@pytest.mark.newest_nats  # about the install, not the server
def test_base_commands_run_without_torch(broker, js, run_name, tmp_path):
    """``pip install seamlessflow`` without torch, simulated: this venv's Python with a
    ``sitecustomize`` on PYTHONPATH that makes ``import torch`` / ``transformers`` / ``vllm``
    raise ModuleNotFoundError, as in an environment that lacks them. (The other base
    dependencies are this venv's; a fresh venv is not built, so an undeclared dependency other
    than these three would not be caught here.) Runs the installed ``seamlessflow`` script."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NO_TORCH)
    script = Path(sys.executable).with_name("seamlessflow")
    env = {**os.environ, "PYTHONPATH": str(hook)}

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(script), *args], input=stdin, capture_output=True, text=True, timeout=60, env=env
        )
        assert "No module named" not in done.stderr, done.stderr
        return done

    # The hook works: the same Python cannot import torch.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env
    )
    assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr

    assert run("--help").returncode == 0
    for command in ("worker", "gateway", "trainer", "agents", "trajectory", "broker"):
        assert run(command, "--help").returncode == 0
    assert run("schema", "export", str(tmp_path / "schemas")).returncode == 0
    config = _config(tmp_path, run_name)
    done = run("provision", "--nats", broker.url, "--config", str(config))
    assert done.returncode == 0 and "15 created" in done.stdout, done.stderr
    task = json.dumps({"task_id": "a", "messages": [{"role": "user", "content": "1+1"}]})
    done = run("submit", "--nats", broker.url, "--run", run_name, "-", stdin=task + "\n")
    assert done.returncode == 0 and "submitted 1 tasks" in done.stdout, done.stderr
    assert run("status", "--nats", broker.url, "--run", run_name).returncode == 0
    done = run("dead-letters", "--nats", broker.url, "--run", run_name)
    assert done.returncode == 0 and "0 dead letters" in done.stdout, done.stderr

    standalone = subprocess.Popen(
        [str(script), "broker", "--state-dir", str(tmp_path / "b"), "--binary", str(broker.binary)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        while not lines or ("broker ready:" not in lines[-1] and lines[-1]):
            lines.append(standalone.stdout.readline())
        assert "broker ready: nats=nats://" in lines[-1], "".join(lines)
    finally:
        standalone.send_signal(signal.SIGTERM)
        rest = standalone.communicate(timeout=30)[0]
    assert standalone.returncode == 0 and "broker stopped" in rest, rest
