"""``seamlessflow slurm``: the rendered sbatch script, checked by structure and by running it.

The script runs under bash with stand-ins for ``srun`` (runs each task's command locally with
the task's ``SLURMD_NODENAME``/``SLURM_LOCALID``), ``scontrol`` (prints the node list) and for
``seamlessflow`` and ``nats-server`` (record their argv and exit), so every command line is
checked as the nodes would run it: each ``seamlessflow`` one parses with the real parser and
its settings validate with the run config the script wrote; the NATS config it wrote passes
``nats-server -t``. The same script goes to a real Slurm unchanged (the network-namespace
harness can ``sbatch`` it).
"""

import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from broker.auth import Identity
from broker.permissions import Principal
from broker.server import find_nats_server
from rollout.gateway.keys import load_keys, read_key_file
from seamlessflow import cli
from seamlessflow.cli import build_parser
from seamlessflow.config import RunConfig, load_config, override
from seamlessflow.exceptions import ConfigError
from seamlessflow.flags import apply_flags
from seamlessflow.slurm import plan

ROOT = Path(__file__).parents[1]
SRUN_OPTIONS = {
    "--het-group", "--nodelist", "--nodes", "--ntasks", "--ntasks-per-node", "--overlap",
    "--output", "--gpus-per-task", "--gres", "--job-name",
}  # fmt: skip
FAKE_SRUN = """
import json, os, subprocess, sys
args = sys.argv[1:]
options = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0).partition("=")
    options[key] = value
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"srun": options, "command": args}) + "\\n")
nodes = options["--nodelist"].split(",")
assert len(nodes) == int(options["--nodes"]), options
per_node = int(options.get("--ntasks-per-node", 1))
assert per_node * len(nodes) == int(options["--ntasks"]), options
status = 0
for node in nodes:
    for local in range(per_node):
        env = {**os.environ, "SLURMD_NODENAME": node, "SLURM_LOCALID": str(local)}
        status = max(status, subprocess.run(args, env=env).returncode)
sys.exit(status)
"""
FAKE_SCONTROL = """
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(sys.argv[3].split(",")))
"""
FAKE_RECORDER = """
import json, os, sys
name = os.path.basename(sys.argv[0])
keep = ("SEAMLESSFLOW_NATS_URL", "SEAMLESSFLOW_METRICS_HOST", "SLURMD_NODENAME", "NATS_NAME",
        "NATS_STORE", "SF_CONFIG", "SF_JOB_DIR", "SEAMLESSFLOW_NATS_IDENTITY")
with open(os.environ["FAKE_LOG"], "a") as log:
    env = {k: os.environ[k] for k in keep if k in os.environ}
    log.write(json.dumps({name: sys.argv[1:], "env": env}) + "\\n")
if name == "seamlessflow" and sys.argv[1:2] == ["creds"]:  # the real one: its files are used
    sys.path.insert(0, os.environ["FAKE_ROOT"])
    from seamlessflow import cli
    sys.exit(cli.main(sys.argv[1:]))
failing = os.environ.get("FAKE_FAIL")
sys.exit(1 if failing and failing in sys.argv[1:2] else 0)
"""


def _fake(folder: Path, name: str, source: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    _fake(folder, "srun", FAKE_SRUN)
    _fake(folder, "scontrol", FAKE_SCONTROL)
    _fake(folder, "seamlessflow", FAKE_RECORDER)
    _fake(folder, "nats-server", FAKE_RECORDER)
    return folder


def path_with(fakes: Path) -> str:
    return f"{fakes}:{os.environ['PATH']}"


def render(tmp_path: Path, table: dict, *flags: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(table))
    out = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "slurm", str(path), "--dry-run", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,  # the relative log_dir is the submitting folder's
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return out.stdout


class Job:
    """One run of a rendered script against the stand-ins."""

    def __init__(self, script: str, tmp_path: Path, fakes: Path, groups: list[list[str]], **env):
        self.script = script
        path = tmp_path / "job.sh"
        path.write_text(script)
        self.log = tmp_path / "fake.log"
        every = ",".join(node for nodes in groups for node in nodes)
        slurm_env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": every, **env}
        for i, nodes in enumerate(groups):
            slurm_env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"] = ",".join(nodes)
        self.done = subprocess.run(
            ["bash", str(path)],
            cwd=tmp_path,
            env={
                **os.environ,
                **slurm_env,
                "PATH": path_with(fakes),
                "FAKE_LOG": str(self.log),
                "FAKE_ROOT": str(ROOT),
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.records = [json.loads(line) for line in self.log.read_text().splitlines()]
        self.job_dir = tmp_path / "logs" / "42"

    def calls(self, name: str) -> list[dict]:
        return [r for r in self.records if name in r]

    def seamlessflow(self, monkeypatch) -> list:
        """Every seamlessflow command line, parsed as on its node, its settings validated."""
        parsed = []
        for record in self.calls("seamlessflow"):
            for key, value in record["env"].items():
                monkeypatch.setenv(key, value)
            args = build_parser().parse_args(record["seamlessflow"])
            config = load_config(args.config)
            if hasattr(args, "flags"):
                config = apply_flags(config, args, args.flags)
            parsed.append((args, config, record["env"]))
        return parsed


def base_table(**slurm) -> dict:
    return {"run": "exp-42", "slurm": {"log_dir": "logs", **slurm}}


def check_common(job: Job, monkeypatch, nats: int) -> list:
    """What holds for every script: bash accepts it, it ran, every srun option is a real one,
    the parts' logs are apart, every seamlessflow command parses and validates."""
    assert subprocess.run(["bash", "-n", "-c", job.script]).returncode == 0
    assert job.done.returncode == 0, job.done.stderr
    steps = job.calls("srun")
    for step in steps:
        assert set(step["srun"]) <= SRUN_OPTIONS, step["srun"]
        assert "--overlap" in step["srun"]
    outputs = [step["srun"]["--output"] for step in steps]
    assert len(set(outputs)) == len(outputs)
    servers = job.calls("nats-server")
    assert sorted(r["env"]["NATS_NAME"] for r in servers) == [f"nats-{i}" for i in range(nats)]
    parsed = job.seamlessflow(monkeypatch)
    check_secrets(job, parsed)
    parsed = [(a, c, e) for a, c, e in parsed if a.command != "creds"]
    urls = {env["SEAMLESSFLOW_NATS_URL"] for _, _, env in parsed}
    assert len(urls) == 1 and len(urls.pop().split(",")) == nats
    assert json.loads((job.job_dir / "run.json").read_text())["run"] == "exp-42"
    targets = json.loads((job.job_dir / "scrape_targets.json").read_text())
    assert all("$" not in t["targets"][0] for t in targets)
    return parsed


def check_secrets(job: Job, parsed: list) -> None:
    """``seamlessflow creds`` once, before NATS; the servers include its accounts and every part
    connects as its principal (unless ``[broker] insecure``); the gateway takes keys either way."""
    (creds,) = [r for r in job.records if r.get("seamlessflow", [""])[0] == "creds"]
    assert job.records.index(creds) < job.records.index(job.calls("nats-server")[0])
    secure = not parsed[0][1].broker.insecure
    conf = (job.job_dir / "nats.conf").read_text()
    assert ("include accounts.conf" in conf) is secure
    assert (job.job_dir / "accounts.conf").is_file() is secure
    for args, config, env in parsed:
        if args.command == "creds":
            assert "SEAMLESSFLOW_NATS_IDENTITY" not in env
            continue
        if not secure:
            assert "SEAMLESSFLOW_NATS_IDENTITY" not in env
            continue
        principal = "trainer" if "train" in getattr(config.worker, "tags", []) else args.command
        principal = {"provision": "admin", "worker": "worker"}.get(principal, principal)
        identity = Identity.load(Path(env["SEAMLESSFLOW_NATS_IDENTITY"]))
        assert (identity.run, identity.principal.value) == ("exp-42", principal), args.command
    keys = [c.gateway.keys_file for a, c, _ in parsed if a.command == "gateway"]
    (agent_key,) = [c.agents.gateway_key_file for a, c, _ in parsed if a.command == "agents"]
    gateway_keys = load_keys(keys[0])  # 0600, or refused
    assert gateway_keys.check(read_key_file(agent_key)).scope == "openai"
    assert read_key_file(job.job_dir / "metrics.key")


def check_nats_conf(job: Job, tmp_path: Path, routes: int) -> None:
    """The servers' config is valid (``nats-server -t``), mode 0600, and has ``routes``, each
    with the job's route secret that the cluster wants."""
    path = job.job_dir / "nats.conf"
    conf = path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    assert conf.count("nats://") == routes
    if routes:
        (password,) = re.findall(r'authorization \{ user: route, password: "([\w-]{24})" \}', conf)
        assert conf.count(f"nats://route:{password}@") == routes
    env = {**os.environ, "NATS_NAME": "nats-0", "NATS_STORE": str(tmp_path / "store")}
    check = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(job.job_dir / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_defaults_one_node_kind_one_nats_server(tmp_path, fakes, monkeypatch):
    script = render(tmp_path, base_table())
    assert "hetjob" not in script and "#SBATCH --nodes=2" in script
    job = Job(script, tmp_path, fakes, [["n1", "n2"]])
    parsed = check_common(job, monkeypatch, nats=1)
    commands = sorted(args.command for args, _, _ in parsed)
    parts = ["provision", "trajectory", "scheduler", "scheduler", "trainer", "worker"]
    assert commands == sorted([*parts, "gateway", "agents"])
    (worker,) = [(a, c, e) for a, c, e in parsed if a.command == "worker"]
    assert worker[1].worker.tags == ["rollout", "node=n1"]
    (trainer,) = [env for args, _, env in parsed if args.command == "trainer"]
    assert trainer["SLURMD_NODENAME"] == "n2"  # the trainer on its own node
    # one scheduler on the first node, a standby beside the trainer
    schedulers = [env["SLURMD_NODENAME"] for a, _, env in parsed if a.command == "scheduler"]
    assert sorted(schedulers) == ["n1", "n2"]
    assert all("--het-group" not in step["srun"] for step in job.calls("srun"))  # a homogeneous job
    check_nats_conf(job, tmp_path, routes=0)


def test_mixed_nodes_make_a_heterogeneous_job_with_a_nats_cluster(tmp_path, fakes, monkeypatch):
    table = base_table(
        trainer={"partition": "h100", "gpus_per_node": 8, "tags": ["gpu=h100"]},
        rollout={"partition": "a10", "gpus_per_node": 2, "workers_per_node": 2, "tags": ["a10"]},
    )
    table["provision"] = {"replicas": 3}
    script = render(tmp_path, table, "--rollout-nodes", "3")
    assert script.count("#SBATCH hetjob") == 1
    assert "#SBATCH --partition=a10" in script and "#SBATCH --gpus-per-node=8" in script
    rollout, train = ["r1", "r2", "r3"], ["t1"]
    job = Job(script, tmp_path, fakes, [rollout, train])
    parsed = check_common(job, monkeypatch, nats=3)
    workers = [(c.worker, e["SLURMD_NODENAME"]) for a, c, e in parsed if a.command == "worker"]
    assert len(workers) == 6
    for worker, node in workers:
        assert worker.tags == ["rollout", "a10", f"node={node}"]
    assert len({w.worker_id for w, _ in workers}) == 6
    groups = {step["srun"]["--output"].split("/")[-1]: step["srun"] for step in job.calls("srun")}
    assert groups["trainer.log"]["--het-group"] == "1"
    assert groups["scheduler-standby.log"]["--het-group"] == "1"  # beside the trainer
    assert groups["scheduler-standby.log"]["--gres"] == "none"
    assert groups["trainer.log"]["--gpus-per-task"] == "8"
    assert groups["rollout-%N-%t.log"]["--gpus-per-task"] == "1"
    assert groups["nats-0.log"]["--gres"] == "none"  # GPUs are the workers'
    names = [r["env"]["SLURMD_NODENAME"] for r in job.calls("nats-server")]
    assert sorted(names) == rollout  # NATS on the first nodes
    check_nats_conf(job, tmp_path, routes=3)


def test_multiplexed_and_colocated_trainers_are_workers(tmp_path, fakes, monkeypatch):
    table = base_table(rollout={"nodes": 2})
    table["layout"] = {"kind": "multiplexed"}
    job = Job(render(tmp_path, table), tmp_path, fakes, [["n1", "n2", "n3"]])
    parsed = check_common(job, monkeypatch, nats=3)
    roles = sorted(c.worker.role.value for a, c, _ in parsed if a.command == "worker")
    assert roles == ["rollout", "rollout", "train"]
    identities = [e["SEAMLESSFLOW_NATS_IDENTITY"] for a, _, e in parsed if a.command == "worker"]
    principals = sorted(Identity.load(Path(i)).principal.value for i in identities)
    assert principals == ["trainer", "worker", "worker"]  # the worker tagged train: trainer's
    assert "trainer" not in {a.command for a, _, _ in parsed}

    table = base_table(rollout={"nodes": 0})
    table["layout"] = {"kind": "colocated"}
    colocated = tmp_path / "colocated"
    colocated.mkdir()
    job = Job(render(colocated, table), colocated, fakes, [["n1"]])
    parsed = check_common(job, monkeypatch, nats=1)
    (worker,) = [c.worker for a, c, _ in parsed if a.command == "worker"]
    assert worker.tags == ["train", "rollout", "node=n1"] and worker.role.value == "idle"


@pytest.mark.parametrize("kind", ["disaggregated", "multiplexed"])
def test_a_trainer_group_is_a_worker_a_gpu_on_the_trainer_nodes(tmp_path, fakes, monkeypatch, kind):
    """``[layout.train] count = 4`` on trainer nodes of 2 GPUs: two nodes, a worker a GPU (one
    step), tagged ``train`` alone where disaggregated (no engine), with the trainer's rights and
    checkpoint folder; each scraped."""
    table = base_table(
        trainer={"partition": "h100", "gpus_per_node": 2, "tags": ["gpu=h100"]},
        rollout={"partition": "a10", "gpus_per_node": 1},
    )
    table["layout"] = {"kind": kind, "train": {"count": 4}}
    script = render(tmp_path, table)
    assert "#SBATCH --nodes=2" in script.split("#SBATCH hetjob")[1]  # the trainer's het-group
    job = Job(script, tmp_path, fakes, [["r1"], ["t1", "t2"]])
    parsed = check_common(job, monkeypatch, nats=3)
    assert "trainer" not in {a.command for a, _, _ in parsed}
    serves = ["rollout"] if kind == "multiplexed" else []
    trainers = [
        (c, e) for a, c, e in parsed if a.command == "worker" and c.worker.role != "rollout"
    ]
    ids = sorted(c.worker.worker_id for c, _ in trainers)
    assert ids == ["trainer-t1-0", "trainer-t1-1", "trainer-t2-0", "trainer-t2-1"]
    for config, env in trainers:
        node = env["SLURMD_NODENAME"]
        assert config.worker.tags == ["train", *serves, "gpu=h100", f"node={node}"]
        assert config.worker.role.value == "train" and config.trainer.world_size == 1
        assert config.trainer.checkpoint_dir == job.job_dir.parent / "checkpoints-exp-42"
    steps = {step["srun"]["--output"].split("/")[-1]: step["srun"] for step in job.calls("srun")}
    group = steps["trainer-%N-%t.log"]
    assert (group["--nodes"], group["--ntasks"], group["--ntasks-per-node"]) == ("2", "4", "2")
    assert group["--gpus-per-task"] == "1" and group["--het-group"] == "1"
    assert group["--nodelist"] == "t1,t2"
    targets = json.loads((job.job_dir / "scrape_targets.json").read_text())
    scraped = {t["targets"][0] for t in targets if t["labels"]["job"] == "seamlessflow-worker"}
    assert {"t1:9404", "t1:9405", "t2:9404", "t2:9405"} <= scraped


def test_an_insecure_run_has_an_open_nats_and_a_gateway_with_keys(tmp_path, fakes, monkeypatch):
    table = base_table()
    table["broker"] = {"insecure": True}
    script = render(tmp_path, table)
    assert "include" not in script and "SEAMLESSFLOW_NATS_IDENTITY=" not in script
    job = Job(script, tmp_path, fakes, [["n1", "n2"]], SEAMLESSFLOW_NATS_IDENTITY="/not/mine")
    check_common(job, monkeypatch, nats=1)  # no identity: not even the submitter's
    (creds,) = [
        r["seamlessflow"] for r in job.calls("seamlessflow") if r["seamlessflow"][0] == "creds"
    ]
    assert "--gateway-keys" in creds and "--accounts" not in creds
    assert not (job.job_dir / "auth").exists()
    check_nats_conf(job, tmp_path, routes=0)


def test_a_gateway_keys_file_of_the_config_is_used(tmp_path, fakes, monkeypatch):
    table = base_table()
    table["gateway"] = {"keys_file": "/secrets/keys.toml"}
    table["agents"] = {"gateway_key_file": "/secrets/agents.key"}
    script = render(tmp_path, table)
    assert "--gateway-keys" not in script and "--keys-file" not in script
    assert "--gateway-key-file" not in script  # the config's, read by the parts


def test_a_part_that_keeps_failing_ends_the_job(tmp_path, fakes):
    table = base_table()
    table["supervise"] = {"max_restarts": 2, "backoff_s": 0.01}
    job = Job(render(tmp_path, table), tmp_path, fakes, [["n1", "n2"]], FAKE_FAIL="trajectory")
    assert job.done.returncode == 1
    assert "gave up after 2 restarts" in job.done.stderr
    assert sum(r["seamlessflow"][0] == "trajectory" for r in job.calls("seamlessflow")) == 3


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"layout": {"kind": "colocated"}}, "slurm.rollout.nodes = 0"),
        ({"provision": {"replicas": 3}}, "needs as many NATS servers"),
        ({"slurm": {"nats_servers": 3}}, "needs as many nodes"),
        ({"slurm": {"rollout": {"gpus_per_node": 3, "workers_per_node": 2}}}, "evenly"),
        ({"slurm": {"rollout": {"tags": ["a$b"]}}}, "letters, digits"),
        ({"gateway": {"keys_file": "/keys.toml"}}, "agents.gateway_key_file"),
        (
            {"layout": {"train": {"count": 3}}, "slurm": {"trainer": {"gpus_per_node": 2}}},
            "count = 3 does not fill whole trainer nodes of 2 GPUs",
        ),
    ],
)
def test_configs_it_cannot_run_are_refused(changes, error):
    with pytest.raises(ConfigError, match=error):
        plan(override(RunConfig(), changes))


def test_without_dry_run_it_submits_with_sbatch(tmp_path, fakes, monkeypatch, capsys):
    sbatch = "import sys\nopen(sys.argv[0] + '.in', 'w').write(sys.stdin.read())\n"
    _fake(fakes, "sbatch", sbatch + "print('4711;cluster')")
    monkeypatch.setenv("PATH", path_with(fakes))
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(base_table()))
    assert cli.main(["slurm", str(config), "--job-name", "mine"]) == 0
    assert "submitted job 4711" in capsys.readouterr().out
    submitted = (fakes / "sbatch.in").read_text()
    assert "#SBATCH --job-name=mine" in submitted
    assert (tmp_path / "logs").is_dir()  # sbatch --output's folder must exist
    assert tomllib.loads(config.read_text())["run"] == "exp-42"


def test_a_part_stopped_by_sigterm_ends_cleanly_and_is_not_restarted(tmp_path, fakes):
    job = Job(render(tmp_path, base_table()), tmp_path, fakes, [["n1", "n2"]])
    assert "#SBATCH --signal=B:TERM@120" in job.script
    assert job.script.index("signal_steps sf-") < job.script.index("signal_steps nats-")
    # the run report is written while every part is up
    assert job.script.index("seamlessflow report") < job.script.index("signal_steps sf-")
    supervise = job.job_dir / "supervise.sh"
    part = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stopped', flush=True), sys.exit(0)))\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        ["bash", str(supervise), sys.executable, "-c", part], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "up\n"
    proc.terminate()  # what Slurm does to the step's processes: supervise.sh passes it on
    assert proc.wait(10) == 0
    assert proc.stdout.read() == "stopped\n"  # once: not started again


def test_creds_writes_the_accounts_a_server_config_includes_and_the_gateway_keys(
    tmp_path, nats_binary
):
    """``seamlessflow creds --accounts --gateway-keys``, as the job runs it before NATS: the
    identities (0600), an ``accounts`` file that a config of its own ``include``s (authorization
    on: SF_NOBODY), and the gateway's keys (0600)."""
    creds = [sys.executable, "-m", "seamlessflow.cli", "creds", "--state-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    accounts = tmp_path / "accounts.conf"
    for run in ("exp-1", "exp-2"):  # a second run adds its account beside the first's
        subprocess.run(
            [*creds, "--run", run, "--accounts", str(accounts)],
            check=True,
            capture_output=True,
            env=env,
        )
    for run in ("exp-1", "exp-2"):
        files = sorted((tmp_path / "auth" / run).iterdir())
        assert [f.stem for f in files] == sorted(p.value for p in Principal)
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    text = accounts.read_text()
    block = json.loads(text[text.index("accounts:") + len("accounts:") :])
    assert sorted(block) == ["SF_NOBODY", "SF_exp-1", "SF_exp-2"]
    assert len(block["SF_exp-1"]["users"]) == len(Principal)
    admin = Identity.load(tmp_path / "auth" / "exp-1" / "admin.toml")
    assert admin.public_key in text and admin.seed not in text  # public keys only
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f"listen: 127.0.0.1:4222\njetstream {{ store_dir: {tmp_path / 'js'} }}\n"
        "include accounts.conf\n"  # relative to the including file
    )
    check = subprocess.run(
        [str(nats_binary), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr

    keys_dir = tmp_path / "keys"
    done = subprocess.run(
        [*creds, "--run", "exp-3", "--gateway-keys", str(keys_dir)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "gateway keys:" in done.stdout
    assert not (tmp_path / "auth" / "exp-3").exists()  # the keys alone
    keys = load_keys(keys_dir / "gateway_keys.toml")
    agents, metrics = (read_key_file(keys_dir / f) for f in ("agents.key", "metrics.key"))
    assert keys.check(agents).scope == "openai" and keys.check(metrics).scope == "metrics"
