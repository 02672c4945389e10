"""``seamlessflow slurm``: a run as one sbatch script, rendered from its run config.

The job's nodes are the rollout workers' (``[slurm.rollout]``, the first ones) and the trainer's
(``[slurm.trainer]``, one node, or ``[layout.train] count``: a trainer group); when the two kinds
differ (partition, constraint, GPUs, memory) the job is heterogeneous, a het-group each. First
``seamlessflow creds`` issues, in the job's folder, the run's identities, the servers' accounts and
the gateway's keys (``slurm_job.credentials``; all but the keys skipped with ``[broker] insecure``),
and each part connects as its principal (``slurm_job.as_principal``). NATS servers with JetStream
run on the first nodes (a route cluster of 3 when the job has 3 nodes or more), then the run is
provisioned, then every part is one ``srun`` step with its log in ``<log_dir>/<job id>/``: the
trajectory manager, scheduler, gateway and agent runner on the first node, the trainer on its node
with a standby scheduler beside it (``tagsched.lease``: it leads once the first node's is gone), the
rollout workers on theirs, each worker tagged with its node's tags and ``node=<host>``. A part that
exits is restarted (``[supervise]``); the job ends when one gives up. The script also writes the run
config it was rendered from and ``scrape_targets.json`` (Prometheus ``file_sd``, like
``seamlessflow run``'s) beside the logs.

SIGTERM to the batch script (``scancel --batch --signal=TERM``, or the time limit's
``--signal``) stops the run in order: ``seamlessflow report`` writes the run report
(``summary.json``, ``reward_curve.png``: ``seamlessflow.report``) beside the logs while every
part is up, then the parts' steps stop, then NATS (``slurm_job.stopper``).

The script needs nothing but bash, awk, ``scontrol``, ``srun`` (``squeue`` and ``scancel`` to
stop) and the ``seamlessflow`` and ``nats-server`` commands on the nodes (``[slurm] setup``
lines put them on ``PATH``), so it runs against any Slurm, or against stand-ins of
``srun``/``scontrol`` (tests/test_slurm.py) and, in tests/test_slurm_cluster.py, a real Slurm
on namespace nodes.
"""

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.permissions import Principal
from seamlessflow.config import RunConfig, SlurmConfig, SlurmNodeKind
from seamlessflow.exceptions import ConfigError, InputError
from seamlessflow.slurm_job import (
    ACCOUNTS_FILE,
    KEYS,
    as_principal,
    credentials,
    own_keys,
    secure,
    sf,
    stopper,
    supervised,
    supervisor,
)
from tagsched.spec import Layout

NATS_PORT, NATS_CLUSTER_PORT, NATS_MONITOR_PORT = 4222, 6222, 8222
GATEWAY_PORT = 8000
METRICS_PORTS = {"trajectory": 9401, "scheduler": 9402, "agents": 9403, "trainer": 9404}
STOP_GRACE_S = 120
"""The batch script is sent SIGTERM this long before the time limit (``--signal``): time for
the parts to stop, then NATS."""
WORKER_METRICS_PORT = 9410
"""A node's rollout workers serve /metrics on this port plus their local task id."""
_SAFE_TAG = re.compile(r"^[\w.=:/+@-]+$")


@dataclass(frozen=True)
class Group:
    """Nodes of one kind: ``array`` is the bash array of their host names in the script."""

    role: str  # "rollout" or "trainer"
    kind: SlurmNodeKind
    nodes: int
    het: int | None  # its het-group; None in a homogeneous job
    per_node: int = 1  # workers on each node

    @property
    def array(self) -> str:
        return "ROLLOUT_NODES" if self.role == "rollout" else "TRAIN_NODES"

    @property
    def workers(self) -> int:
        return self.nodes * self.per_node

    @property
    def list(self) -> str:  # their host names, comma-separated (a step's --nodelist)
        return "ROLLOUT_LIST" if self.role == "rollout" else "TRAIN_LIST"

    def host(self, index: int) -> str:
        return f"${{{self.array}[{index}]}}"


@dataclass(frozen=True)
class Plan:
    """Where everything runs: ``groups`` in job order, the NATS servers' nodes."""

    groups: tuple[Group, ...]
    nats: tuple[tuple[Group, int], ...]

    @property
    def heterogeneous(self) -> bool:
        return self.groups[0].het is not None

    @property
    def first(self) -> tuple[Group, int]:
        return self.groups[0], 0

    def group(self, role: str) -> Group | None:
        return next((g for g in self.groups if g.role == role), None)

    @property
    def standby(self) -> Group | None:
        """Where the standby scheduler runs: the trainer's node, when it is not the first node
        (where the active one starts), so losing one node leaves a scheduler; else none."""
        trainer = self.group("trainer")
        return trainer if trainer is not self.groups[0] else None


def plan(config: RunConfig) -> Plan:
    """The job's layout for ``config``; ``ConfigError`` for a config it cannot run."""
    slurm = config.slurm
    rollout, trainer = slurm.rollout, slurm.trainer
    if config.layout.kind is Layout.COLOCATED and rollout.nodes:
        raise ConfigError(
            "layout.kind = 'colocated' runs its workers on the trainer's nodes (one, or "
            "[layout.train] count): set slurm.rollout.nodes = 0 (or use 'multiplexed')"
        )
    if rollout.gpus_per_node % rollout.workers_per_node:
        raise ConfigError(
            f"slurm.rollout.gpus_per_node = {rollout.gpus_per_node} is not shared out evenly "
            f"among workers_per_node = {rollout.workers_per_node}"
        )
    for tag in (*rollout.tags, *trainer.tags):
        if not _SAFE_TAG.match(tag):
            raise ConfigError(f"slurm tag {tag!r}: letters, digits and _.=:/+@- only")
    same = _resources(rollout) == _resources(trainer) or not rollout.nodes
    het = (None, None) if same else (0, 1)
    groups = [Group("rollout", rollout, rollout.nodes, het[0], rollout.workers_per_node)]
    groups = groups * bool(rollout.nodes)
    # A trainer group: a worker a GPU (one rank each), as many a node as the node has GPUs.
    trainers = config.layout.spec().train.count or 1
    per_node = min(trainers, trainer.gpus_per_node or 1)
    if trainers % per_node:
        raise ConfigError(
            f"[layout.train] count = {trainers} does not fill whole trainer nodes of "
            f"{per_node} GPUs (slurm.trainer.gpus_per_node): a worker a GPU"
        )
    groups.append(Group("trainer", trainer, trainers // per_node, het[1], per_node))
    nodes = [(g, i) for g in groups for i in range(g.nodes)]
    count = slurm.nats_servers or (3 if len(nodes) >= 3 else 1)
    if count > len(nodes):
        raise ConfigError(
            f"slurm.nats_servers = {count} needs as many nodes; the job has {len(nodes)}"
        )
    if config.gateway.keys_file is not None and config.agents.gateway_key_file is None:
        raise ConfigError(
            f"gateway.keys_file is {config.gateway.keys_file}: set agents.gateway_key_file to a "
            "file holding one of its openai keys, for the agents"
        )
    if config.provision.replicas > count:
        raise ConfigError(
            f"provision.replicas = {config.provision.replicas} needs as many NATS servers; the "
            f"job runs {count} (slurm.nats_servers)"
        )
    return Plan(tuple(groups), tuple(nodes[:count]))


def _resources(kind: SlurmNodeKind) -> tuple:
    return kind.partition, kind.constraint, kind.gpus_per_node, kind.mem


def render(config: RunConfig, table: dict[str, Any], source: str) -> str:
    """The sbatch script of ``config`` (read from ``table``, the run config as given, which
    the script hands every part); ``source`` names it in the script's first lines."""
    p = plan(config)
    slurm = config.slurm
    log_dir = slurm.log_dir.expanduser().absolute()
    sections = [
        _header(p, slurm, log_dir, config.run, source),
        "set -euo pipefail\n",
        *(f"{line}\n" for line in slurm.setup),
        _nodes(p, log_dir, table),
        stopper(config),
        credentials(config),
        _nats(p, config),
        supervisor(config),
        _targets(p, config),
        _parts(p, config, log_dir),
    ]
    return "\n".join(sections)


def _header(p: Plan, slurm: SlurmConfig, log_dir: Path, run: str, source: str) -> str:
    lines = [
        "#!/bin/bash",
        f"# SeamlessFlow run {run!r} on Slurm, rendered by `seamlessflow slurm` from {source}:",
        "# render it again rather than editing it. Logs: <log_dir>/<job id>/<part>.log.",
        f"#SBATCH --job-name={slurm.job_name}",
        f"#SBATCH --time={slurm.time}",
        f"#SBATCH --output={log_dir}/{slurm.job_name}-%j.log",
        # Before the time limit, SIGTERM to this script: it stops the parts, then NATS.
        f"#SBATCH --signal=B:TERM@{STOP_GRACE_S}",
    ]
    if slurm.account:
        lines.append(f"#SBATCH --account={slurm.account}")
    if not p.heterogeneous:
        nodes = sum(g.nodes for g in p.groups)
        return "\n".join([*lines, *_component(p.groups[-1].kind, nodes, slurm)]) + "\n"
    for group in p.groups:
        if group.het:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het-group {group.het}: the {group.role} nodes")
        lines += _component(group.kind, group.nodes, slurm)
    return "\n".join(lines) + "\n"


def _component(kind: SlurmNodeKind, nodes: int, slurm: SlurmConfig) -> list[str]:
    options = [f"--nodes={nodes}", "--exclusive"]
    options += [f"--partition={kind.partition}"] * bool(kind.partition)
    options += [f"--constraint={kind.constraint}"] * bool(kind.constraint)
    options += [f"--gpus-per-node={kind.gpus_per_node}"] * bool(kind.gpus_per_node)
    options += [f"--mem={kind.mem}"] * (kind.mem is not None)
    return [f"#SBATCH {option}" for option in (*options, *slurm.sbatch)]


def _nodes(p: Plan, log_dir: Path, table: dict[str, Any]) -> str:
    """The host arrays, the job's folder and the run config every part reads."""
    lines = []
    if p.heterogeneous:
        for g in p.groups:
            nodelist = f'"$SLURM_JOB_NODELIST_HET_GROUP_{g.het}"'
            lines.append(f"mapfile -t {g.array} < <(scontrol show hostnames {nodelist})")
    else:
        lines.append('mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")')
        start = 0
        for g in p.groups:
            lines.append(f'{g.array}=("${{NODES[@]:{start}:{g.nodes}}}")')
            start += g.nodes
    for g in p.groups:
        if g.role == "rollout" or g.workers > 1:  # a step across the group
            lines.append(f'{g.list}=$(IFS=,; echo "${{{g.array}[*]}}")')
    config = json.dumps(table, indent=2, default=str)
    lines += [
        "SF_STARTED=$(date +%s)",
        f'export SF_JOB_DIR="{log_dir}/$SLURM_JOB_ID"',
        'mkdir -p "$SF_JOB_DIR"',
        "# The run config as given: every part reads its section.",
        'export SF_CONFIG="$SF_JOB_DIR/run.json"',
        f"cat > \"$SF_CONFIG\" <<'SF_CONFIG_EOF'\n{config}\nSF_CONFIG_EOF",
    ]
    return "\n".join(lines) + "\n"


def _nats(p: Plan, config: RunConfig) -> str:
    """The NATS servers' config (one file; each server's name and store from its environment)
    and one step each."""
    slurm = config.slurm
    hosts = [g.host(i) for g, i in p.nats]
    conf = [
        "server_name: \\$NATS_NAME",
        f"listen: 0.0.0.0:{NATS_PORT}",
        f"http: 0.0.0.0:{NATS_MONITOR_PORT}",
        f"max_payload: {config.broker.max_payload}",
        "jetstream {",
        "  store_dir: \\$NATS_STORE",
        f"  max_file_store: {slurm.nats_max_file_store}",
        "}",
    ]
    lines = [
        f"# NATS: {len(hosts)} server(s) with JetStream" + (", a route cluster" * (len(hosts) > 1))
    ]
    if len(hosts) > 1:
        # With authorization on, only a server that knows the job's route secret joins.
        login = "route:${SF_ROUTE_SECRET}@" if secure(config) else ""
        routes = [f"    nats://{login}{host}:{NATS_CLUSTER_PORT}" for host in hosts]
        conf += ["cluster {", "  name: seamlessflow", f"  listen: 0.0.0.0:{NATS_CLUSTER_PORT}"]
        if secure(config):
            lines.append("SF_ROUTE_SECRET=$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')")
            conf.append('  authorization { user: route, password: "${SF_ROUTE_SECRET}" }')
        conf += ["  routes: [", *routes, "  ]", "}"]
    if secure(config):
        # every run an account, every part an nkey with its rights (broker.auth); relative to
        # this file
        conf.append(f"include {ACCOUNTS_FILE}")
    urls = ",".join(f"nats://{host}:{NATS_PORT}" for host in hosts)
    lines += [
        '(umask 077; cat > "$SF_JOB_DIR/nats.conf") <<NATS_EOF  # mode 0600: it holds the secret',
        *conf,
        "NATS_EOF",
        f'export SEAMLESSFLOW_NATS_URL="{urls}"',
        "export SEAMLESSFLOW_METRICS_HOST=0.0.0.0  # /metrics reachable from Prometheus",
        'echo "job $SLURM_JOB_ID: NATS at $SEAMLESSFLOW_NATS_URL (logs in $SF_JOB_DIR)"',
        *(f'echo "nats-{n} on {g.host(i)}"' for n, (g, i) in enumerate(p.nats)),
    ]
    for n, (group, index) in enumerate(p.nats):
        store = shlex.quote(f"{slurm.nats_store.rstrip('/')}") + f'/"$SLURM_JOB_ID"/nats-{n}'
        command = (
            f"NATS_NAME=nats-{n} NATS_STORE={store} "
            f'exec {shlex.quote(slurm.nats_server)} -c "$SF_JOB_DIR/nats.conf"'
        )
        lines.append(_step(f"nats-{n}", _on(group, index), command, pids="NATS_PIDS"))
    return "\n".join(lines) + "\n"


def _on(group: Group, index: int, gpus: int = 0) -> list[str]:
    """srun options for one task on one node of ``group``, with ``gpus`` of the node's GPUs
    (a step gets all of the job's otherwise)."""
    het = [f"--het-group={group.het}"] if group.het is not None else []
    options = [*het, f'--nodelist="{group.host(index)}"', "--nodes=1", "--ntasks=1"]
    return options + _gpus(group.kind, gpus)


def _across(group: Group, gpus: int) -> list[str]:
    """srun options for ``group.per_node`` tasks on every node of ``group``, ``gpus`` each."""
    where = [f"--het-group={group.het}"] if group.het is not None else []
    where += [f'--nodelist="${group.list}"', f"--nodes={group.nodes}"]
    where += [f"--ntasks={group.workers}", f"--ntasks-per-node={group.per_node}"]
    return where + _gpus(group.kind, gpus)


def _gpus(kind: SlurmNodeKind, per_task: int) -> list[str]:
    if per_task:
        return [f"--gpus-per-task={per_task}"]
    return ["--gres=none"] if kind.gpus_per_node else []


def _step(name: str, where: list[str], command: str, *, pids: str | None = "PART_PIDS") -> str:
    """One srun step running ``command`` (bash, expanded on the node) with its own log; in the
    background with its srun's pid added to the bash array ``pids`` unless that is None. The
    step is named ``nats-<n>`` or ``sf-<part>`` (``stop`` signals the steps by name)."""
    step_name = name.split("-%")[0] if name.startswith("nats-") else f"sf-{name.split('-%')[0]}"
    options = [*where, "--overlap", f"--job-name={step_name}"]
    options = " ".join([*options, f'--output="$SF_JOB_DIR/{name}.log"'])
    step = f"srun {options} \\\n  bash -c {shlex.quote(command)}"
    return step if pids is None else f"{step} &\n{pids}+=($!)"


def _targets(p: Plan, config: RunConfig) -> str:
    """Prometheus ``file_sd`` targets of every part (``seamlessflow.targets``' shape)."""
    first = p.first[0].host(0)
    trainer = p.group("trainer")
    assert trainer is not None
    hosts = [(f"{first}:{METRICS_PORTS[kind]}", kind) for kind in ("trajectory", "scheduler")]
    if p.standby:
        hosts.append((f"{p.standby.host(0)}:{METRICS_PORTS['scheduler']}", "scheduler"))
    hosts += [
        (f"{first}:{GATEWAY_PORT}", "gateway"),
        (f"{first}:{METRICS_PORTS['agents']}", "agents"),
    ]
    for group, port, kind in (
        (trainer, METRICS_PORTS["trainer"], _trainer_kind(config, trainer)),
        (p.group("rollout"), WORKER_METRICS_PORT, "worker"),
    ):
        if group is not None:
            hosts += [
                (f"{group.host(i)}:{port + w}", kind)
                for i in range(group.nodes)
                for w in range(group.per_node)
            ]
    groups = [
        {"targets": [target], "labels": {"job": f"seamlessflow-{kind}", "run": config.run}}
        for target, kind in hosts
    ]
    body = "[\n" + ",\n".join(json.dumps(group) for group in groups) + "\n]"
    return f'cat > "$SF_JOB_DIR/scrape_targets.json" <<TARGETS_EOF\n{body}\nTARGETS_EOF\n'


def _trainer_kind(config: RunConfig, trainer: Group) -> str:
    """``trainer`` for one ``seamlessflow trainer`` process, else ``worker``."""
    alone = config.layout.kind is Layout.DISAGGREGATED and trainer.workers == 1
    return "trainer" if alone else "worker"


def _parts(p: Plan, config: RunConfig, log_dir: Path) -> str:
    """Provisioning (retried until NATS answers), then one step per part, then wait."""
    first = _on(*p.first)
    gateway = f"http://{p.first[0].host(0)}:{GATEWAY_PORT}/v1"
    provision = f"for try in $(seq 60); do {sf('provision')} && exit 0; sleep 2; done; exit 1"
    provision = as_principal(config, Principal.ADMIN, provision)
    ports = METRICS_PORTS
    keyed = own_keys(config)
    steps = [
        "# The run's streams, consumers and buckets, once NATS answers.",
        _step("provision", first, provision, pids=None),
        f'export SF_GATEWAY="{gateway}"',
    ]
    for name in ("trajectory", "scheduler"):
        command = sf(name, f"--metrics-port {ports[name]}")
        steps.append(_step(name, first, as_principal(config, Principal(name), supervised(command))))
    first_host = p.first[0].host(0)
    steps += [f'echo "{part} on {first_host}"' for part in ("trajectory", "scheduler")]
    if standby := p.standby:
        command = sf("scheduler", f"--metrics-port {ports['scheduler']}")
        command = as_principal(config, Principal.SCHEDULER, supervised(command))
        steps.append(_step("scheduler-standby", _on(standby, 0), command))
        steps.append(f'echo "scheduler (standby) on {standby.host(0)}"')
    steps.append(_trainer_step(p, config, log_dir))
    trainer = p.group("trainer")
    assert trainer is not None
    where = trainer.host(0) if trainer.nodes == 1 else f"${trainer.list}"
    if trainer.per_node > 1:
        where += f" ({trainer.per_node} a node)"
    steps.append(f'echo "trainer on {where}"')
    if rollout := p.group("rollout"):
        steps.append(_rollout_step(rollout, config))
        steps.append(f'echo "rollout workers ({rollout.per_node} a node) on $ROLLOUT_LIST"')
    # The gateway listens on every address: always with keys, the job's own unless the config
    # names a keys file (and the agents' key file) of its own.
    keys = f'--keys-file "$SF_JOB_DIR/{KEYS["keys_file"]}"'
    gateway_cmd = sf("gateway", f"--host 0.0.0.0 --port {GATEWAY_PORT}", *[keys] * keyed)
    steps.append(
        _step("gateway", first, as_principal(config, Principal.GATEWAY, supervised(gateway_cmd)))
    )
    key = f'--gateway-key-file "$SF_JOB_DIR/{KEYS["agents"]}"'
    agents = sf(
        "agents",
        '--gateway "$SF_GATEWAY"',
        f"--metrics-port {ports['agents']}",
        *[key] * keyed,
    )
    steps.append(_step("agents", first, as_principal(config, Principal.AGENTS, supervised(agents))))
    steps += [f'echo "{part} on {first_host}"' for part in ("gateway", "agents")]
    steps += [
        "# Until a step fails (a part gave up, a NATS server died), the time limit or scancel:",
        "# then the job ends and Slurm stops the other steps. A part that ends cleanly (0) does",
        "# not end the job.",
        "status=0",
        'while [ -n "$(jobs -pr)" ]; do',
        "  wait -n || { status=$?; break; }",
        "done",
        '[ "$status" -eq 0 ] || echo "a step failed (status $status): ending the job" >&2',
        'exit "$status"',
    ]
    return "\n".join(steps) + "\n"


def _trainer_step(p: Plan, config: RunConfig, log_dir: Path) -> str:
    """The trainer on its node: ``seamlessflow trainer`` (disaggregated), or a worker tagged
    train and rollout that holds it (multiplexed, colocated); a trainer group
    (``[layout.train] count`` above one) is one worker a GPU on the trainer's nodes, in one
    step, tagged ``train`` alone where disaggregated (no engine). They share the checkpoint
    folder, so a member that becomes rank 0 resumes."""
    group = p.group("trainer")
    assert group is not None
    kind = config.layout.kind
    checkpoints = config.trainer.checkpoint_dir or log_dir / f"checkpoints-{config.run}"
    args = [f"--checkpoint-dir {shlex.quote(str(checkpoints))}"]
    several = group.workers > 1
    port = METRICS_PORTS["trainer"]
    args.append(
        f"--metrics-port $(({port} + SLURM_LOCALID))" if several else f"--metrics-port {port}"
    )
    if _trainer_kind(config, group) == "trainer":
        command = sf("trainer", *args)
    else:
        role = "idle" if kind is Layout.COLOCATED else "train"
        serves = ["rollout"] if kind is not Layout.DISAGGREGATED else []
        tags = ",".join(["train", *serves, *group.kind.tags, "node=$SLURMD_NODENAME"])
        command = sf(
            "worker",
            f'--tags "{tags}"',
            f"--role {role}",
            f'--worker-id "trainer-$SLURMD_NODENAME{"-$SLURM_LOCALID" * several}"',
            *args,
        )
    name, where = "trainer", _on(group, 0, group.kind.gpus_per_node)
    if several:  # a GPU each
        name, where = "trainer-%N-%t", _across(group, 1 if group.kind.gpus_per_node else 0)
    # the trainer's rights, a worker tagged train too (it holds the trainer)
    return _step(name, where, as_principal(config, Principal.TRAINER, supervised(command)))


def _rollout_step(group: Group, config: RunConfig) -> str:
    """Every rollout worker in one step: ``workers_per_node`` tasks on each rollout node."""
    kind = config.slurm.rollout
    where = _across(group, kind.gpus_per_node // group.per_node)
    tags = ",".join(["rollout", *kind.tags, "node=$SLURMD_NODENAME"])
    command = sf(
        "worker",
        f'--tags "{tags}"',
        "--role rollout",
        '--worker-id "rollout-$SLURMD_NODENAME-$SLURM_LOCALID"',
        f"--metrics-port $(({WORKER_METRICS_PORT} + SLURM_LOCALID))",
    )
    return _step(
        "rollout-%N-%t", where, as_principal(config, Principal.WORKER, supervised(command))
    )


def submit(script: str, log_dir: Path) -> str:
    """``sbatch`` the script (the log folder made first: Slurm does not); the job id."""
    log_dir.expanduser().mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError as exc:
        raise InputError("sbatch is not on PATH: run on a Slurm login node, or --dry-run") from exc
    if done.returncode:
        raise InputError(f"sbatch refused the script: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]
