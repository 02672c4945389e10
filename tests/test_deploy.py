"""deploy/k8s: every overlay renders with kustomize, every object is valid against the Kubernetes
schemas (offline, kubernetes-validate's bundled ones), and the deployment's invariants hold:
each container runs a real ``seamlessflow`` subcommand whose flags parse and whose settings are
valid with the mounted run config, each part has a readiness probe and scrape annotations,
workers carry their node's tag, NATS is a 3-server cluster on the GPU cluster. NATS runs with
authorization on (a real nats-server on each overlay's config refuses anonymous clients), and
each part connects as its own principal with that identity file only.
"""

import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from broker.auth import IDENTITY_ENV, Authority, Identity, write_routes
from broker.client import session
from broker.exceptions import AuthorizationError
from broker.permissions import Principal
from broker.provision import provision_run
from broker.server import find_nats_server
from seamlessflow.cli import build_parser
from seamlessflow.config import RunConfig, load_config
from seamlessflow.flags import apply_flags
from seamlessflow.targets import job_name
from tests.support import free_port

ROOT = Path(__file__).parents[1]
OVERLAYS = ("single-node", "gpu-cluster", "trainer-group")
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against
PARTS = {"trajectory", "scheduler", "gateway", "agents", "trainer", "rollout"}
# What the downward API and the cluster put in $(VAR) references, for parsing the args.
ENV_EXAMPLES = {"NODE_NAME": "gpu-node-7", "POD_NAME": "rollout-6d5f9c7b8-x2k4q"}
# The Secrets made once per run (deploy/k8s/base/kustomization.yaml): the NATS servers' accounts
# (`seamlessflow creds --accounts`) and every principal's identity (auth/RUN/ of its --state-dir).
ACCOUNTS = "seamlessflow-nats-accounts"
ROUTES = "seamlessflow-nats-routes"
IDENTITIES = "seamlessflow-nats-identities"

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl (v1.27+, with kustomize) is not installed: the CI must install it",
)


def render(overlay: str) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def named(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def config_map(objects: list[dict], volume: dict) -> dict:
    """The ConfigMap a pod volume mounts (kustomize gave it a hashed name)."""
    return named(objects, "ConfigMap", volume["configMap"]["name"])


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered, capsys):
    overlay, objects = rendered
    for obj in objects:
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")
    kinds = sorted({o["kind"] for o in objects})
    with capsys.disabled():
        print(f"\n{overlay}: {len(objects)} objects valid for Kubernetes {K8S_VERSION} ({kinds})")
    assert len(objects) >= 17


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg)


def environment(objects: list[dict], container: dict) -> dict[str, str]:
    """The container's environment: its envFrom ConfigMaps, then its env values."""
    env = {}
    for source in container.get("envFrom", []):
        env |= named(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    return env | {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def parse(objects: list[dict], container: dict, monkeypatch):
    """The container's args parsed as the pod parses them: in its environment (e.g.
    SEAMLESSFLOW_NATS_URL, which --nats defaults to), $(VAR)s expanded."""
    for name in [n for n in os.environ if n.startswith("SEAMLESSFLOW_")]:
        monkeypatch.delenv(name)
    for key, value in environment(objects, container).items():
        monkeypatch.setenv(key, value)
    return build_parser().parse_args([expand(a, ENV_EXAMPLES) for a in container["args"]])


def seamlessflow_containers(objects: list[dict]):
    """(workload, pod spec, container) of every container running the SeamlessFlow image."""
    for obj in workloads(objects):
        pod = obj["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if container["image"].startswith("ghcr.io/seamlessflow/seamlessflow:"):
                yield obj, pod, container


def settings(objects: list[dict], pod: dict, args, path: Path) -> RunConfig:
    """What the part runs with, as it checks at start: the run config its pod mounts (written to
    ``path``) with its flags applied."""
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    path.write_text(config_map(objects, volume)["data"]["run.toml"])
    config = load_config(path)
    return apply_flags(config, args, args.flags) if hasattr(args, "flags") else config


def test_every_container_runs_a_seamlessflow_command_that_parses(rendered, tmp_path, monkeypatch):
    overlay, objects = rendered
    commands = set()
    for obj, pod, container in seamlessflow_containers(objects):
        assert container["command"] == ["seamlessflow"], container["name"]
        defined = {e["name"] for e in container.get("env", [])}
        used = set(re.findall(r"\$\((\w+)\)", " ".join(container["args"])))
        assert used <= defined, f"{container['name']} uses undefined {used - defined}"
        args = parse(objects, container, monkeypatch)
        assert args.nats == "nats://nats:4222"
        commands.add(args.command)
        # The --config it names is the run config ConfigMap's file, and with the flags applied
        # the settings validate together, as the part itself checks at start.
        assert args.config == Path("/etc/seamlessflow/run.toml")
        settings(objects, pod, args, tmp_path / f"{obj['metadata']['name']}.toml")
    # the trainer group's members are workers tagged train
    trainer = set() if overlay == "trainer-group" else {"trainer"}
    assert commands == {
        "provision", "trajectory", "scheduler", "gateway", "agents", "worker", *trainer
    }, overlay  # fmt: skip


def principal(args, config: RunConfig) -> Principal:
    """Whom a command connects to NATS as, by the launchers' rule (seamlessflow/run.py,
    seamlessflow/slurm.py): provisioning as the admin, a worker tagged train as the trainer (it
    may train), every other command as its namesake."""
    if args.command == "provision":
        return Principal.ADMIN
    if args.command == "worker" and "train" in config.worker.tags:
        return Principal.TRAINER
    return Principal(args.command)


def test_each_part_connects_as_its_principal_with_that_identity_only(
    rendered, tmp_path, monkeypatch
):
    """Every container that connects to NATS has $SEAMLESSFLOW_NATS_IDENTITY at a file of the
    identities Secret whose key is its principal's, mode 0400 (a part refuses an identity others
    may read); no pod mounts a key it does not connect with (the NATS pods: none)."""
    overlay, objects = rendered
    principals = set()
    for obj in workloads(objects):
        pod = obj["spec"]["template"]["spec"]
        where = f"{overlay}: {obj['metadata']['name']}"
        secrets = {
            v["name"]: v["secret"]
            for v in pod["volumes"]
            if v.get("secret", {}).get("secretName") == IDENTITIES
        }
        projected = [s for v in pod["volumes"] for s in v.get("projected", {}).get("sources", [])]
        assert all(s.get("secret", {}).get("name") != IDENTITIES for s in projected), where
        assert all("items" in s for s in secrets.values()), f"{where} mounts every identity"
        mounted = {i["key"] for s in secrets.values() for i in s["items"]}
        used = set()
        for _, _, container in seamlessflow_containers([obj]):
            args = parse(objects, container, monkeypatch)
            if not hasattr(args, "nats"):
                continue
            expected = principal(args, settings(objects, pod, args, tmp_path / "run.toml"))
            path = Path(environment(objects, container)[IDENTITY_ENV])
            (mount,) = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
            secret = secrets[mount["name"]]
            (item,) = [
                i
                for i in secret["items"]
                if path.relative_to(mount["mountPath"]) == Path(i["path"])
            ]
            assert item["key"] == f"{expected.value}.toml", where
            mode = item.get("mode", secret.get("defaultMode"))
            assert mode == 0o400, f"{where}: {item['key']} mode {mode:o}"
            used.add(item["key"])
            principals.add(expected)
        assert mounted == used, f"{where} mounts {sorted(mounted - used)} it does not connect as"
    assert principals == {
        Principal.ADMIN, Principal.SCHEDULER, Principal.TRAJECTORY, Principal.TRAINER,
        Principal.WORKER, Principal.GATEWAY, Principal.AGENTS,
    }, overlay  # fmt: skip


def test_every_part_has_a_readiness_probe_and_scrape_annotations(rendered):
    overlay, objects = rendered
    served = set()
    for obj in workloads(objects):
        if obj["kind"] == "Job":
            continue  # provisioning runs once
        template = obj["spec"]["template"]
        served.add(obj["metadata"]["labels"]["app.kubernetes.io/component"])
        notes = template["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", obj["metadata"]["name"]
        ports = {
            p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
        }
        assert int(notes["prometheus.io/port"]) in ports
        for container in template["spec"]["containers"]:
            probe = container.get("readinessProbe")
            assert probe and "httpGet" in probe, f"{overlay}: {container['name']} has no probe"
    assert served == PARTS | {"nats"}
    labels_match_the_dashboards(objects)
    env = named(objects, "ConfigMap", _env_name(objects))["data"]
    assert env["SEAMLESSFLOW_METRICS_HOST"] == "0.0.0.0"  # probes reach /metrics


def labels_match_the_dashboards(objects: list[dict]) -> None:
    """Each part's pods carry the job and run labels the dashboards filter on (Prometheus takes
    them from the pod labels: deploy/k8s/prometheus-scrape.yaml), the job by its command."""
    run = tomllib.loads(named_config(objects))["run"]
    for obj in workloads(objects):
        template = obj["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert labels["seamlessflow.io/run"] == run
        (container, *_) = template["spec"]["containers"]
        if container["image"].startswith("ghcr.io/seamlessflow/") and obj["kind"] != "Job":
            assert labels["seamlessflow.io/job"] == job_name(container["args"][0])
    scrape = yaml.safe_load((ROOT / "deploy" / "k8s" / "prometheus-scrape.yaml").read_text())
    targets = {r.get("target_label"): r.get("source_labels") for r in scrape[0]["relabel_configs"]}
    assert targets["job"] == ["__meta_kubernetes_pod_label_seamlessflow_io_job"]
    assert targets["run"] == ["__meta_kubernetes_pod_label_seamlessflow_io_run"]


def _env_name(objects: list[dict]) -> str:
    return next(
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("seamlessflow-env-")
    )


def test_rollout_workers_are_tagged_with_their_node(rendered, monkeypatch):
    overlay, objects = rendered
    pod = named(objects, "Deployment", "rollout")["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    env = {e["name"]: e.get("valueFrom", {}) for e in worker["env"]}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    args = parse(objects, worker, monkeypatch)
    tags = apply_flags(load_config(None), args, args.flags).worker.tags
    assert "node=gpu-node-7" in tags and "rollout" in tags, overlay


def nats_files(objects: list[dict], folder: Path) -> tuple[Path, dict[Principal, Path]]:
    """The NATS pods' config volume written to ``folder/nats`` as it is mounted: the ConfigMap's
    nats.conf and, beside it, the accounts Secret's accounts.conf as ``seamlessflow creds
    --config <run.toml> --accounts`` writes it (the run config in ``folder``, the run's identities
    issued in ``folder/auth``). Returns the file the server's ``-c`` names and the identities."""
    pod = named(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]
    (server,) = [c for c in pod["containers"] if c["name"] == "nats"]
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "config"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    (folder / "run.toml").write_text(named_config(objects))
    config = load_config(folder / "run.toml")
    authority = Authority(folder / "auth", config.broker.account)
    identities = authority.issue_run(config.run)
    (folder / "nats").mkdir()
    for source in volume["projected"]["sources"]:
        if "configMap" in source:
            for key, text in config_map(objects, source)["data"].items():
                (folder / "nats" / key).write_text(text)
        elif source["secret"]["name"] == ACCOUNTS:
            (item,) = source["secret"]["items"]
            assert item["key"] == "accounts.conf"
            authority.write_accounts(folder / "nats" / item["path"])
        else:  # as `seamlessflow creds --routes` writes it, for the StatefulSet's pods
            (item,) = source["secret"]["items"]
            assert (source["secret"]["name"], item["key"]) == (ROUTES, "routes.conf")
            assert source["secret"]["optional"]  # a lone server has no routes
            stateful = named(objects, "StatefulSet", "nats")["spec"]
            hosts = [f"nats-{i}.{stateful['serviceName']}:6222" for i in range(3)]
            write_routes(folder / "nats" / item["path"], hosts)
    assert server["args"][0] == "-c"
    return folder / "nats" / Path(server["args"][1]).relative_to(mount["mountPath"]), identities


@contextmanager
def nats_here(conf: Path, binary: Path) -> Iterator[str]:
    """A real nats-server on the pods' config ``conf``, run here: clients on a free loopback
    port, no monitor port, no routes (its peers are pods), the store and pid file beside
    ``conf``. Yields its URL."""
    port = free_port()
    text = re.sub(r"\ncluster \{.*?\n\}\n", "\n", conf.read_text(), flags=re.S)
    for pods, here in (
        ("0.0.0.0:4222", f"127.0.0.1:{port}"),
        ("http: 0.0.0.0:8222", ""),
        ("/data", str(conf.parent / "data")),
        ("/var/run/nats", str(conf.parent)),
    ):
        assert pods in text, conf
        text = text.replace(pods, here)
    conf.write_text(text)
    log = conf.parent / "nats.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(binary), "-c", str(conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "POD_NAME": "nats-0"},
        )
    try:
        yield f"nats://127.0.0.1:{port}"
    except BaseException:
        if server.poll() is not None:
            pytest.fail(f"nats-server exited {server.returncode}: {log.read_text()[-2000:]}")
        raise
    finally:
        server.terminate()
        server.wait(10)


def test_nats_is_a_jetstream_statefulset_with_storage(rendered, tmp_path):
    overlay, objects = rendered
    nats = named(objects, "StatefulSet", "nats")
    replicas = nats["spec"]["replicas"]
    assert replicas == {"single-node": 1, "gpu-cluster": 3, "trainer-group": 3}[overlay]
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    headless = named(objects, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    path, _ = nats_files(objects, tmp_path)
    conf = path.read_text()
    # a cluster takes only routes with the secret of routes.conf (the Secret, beside nats.conf)
    clustered = re.search(r"\ncluster \{[^}]*\n  include routes.conf\n\}", conf)
    assert bool(clustered) == (replicas > 1), conf
    run = tomllib.loads(named_config(objects))
    assert run["provision"]["replicas"] == replicas  # streams replicated on every server
    # The server accepts the config (nats-server -t), with $POD_NAME as the pod gives it and
    # the accounts it includes.
    path.write_text(conf.replace("/data", str(tmp_path / "data")))
    check = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "POD_NAME": "nats-0"},
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_nats_refuses_anonymous_clients_and_admits_the_runs_identities(
    rendered, tmp_path, nats_binary, monkeypatch
):
    """A real nats-server on the overlay's config, with the accounts issued for real beside it:
    an anonymous client and an identity of another run are refused, every identity of the run
    connects."""
    _, objects = rendered
    conf, identities = nats_files(objects, tmp_path)
    stranger = Identity.new("stranger", Principal.ADMIN).save(tmp_path / "stranger.toml")
    monkeypatch.delenv(IDENTITY_ENV, raising=False)  # anonymous: no identity at all
    with nats_here(conf, nats_binary) as url:
        for who, identity in identities.items():  # the first waits for the server to listen
            async with session(url, f"k8s-{who}", give_up_after=10, identity_file=identity) as nc:
                assert nc.is_connected
        for identity in (None, stranger):
            with pytest.raises(AuthorizationError):
                async with session(url, "k8s-refused", identity_file=identity):
                    pass


async def test_the_single_node_run_is_provisioned_within_its_account(tmp_path):
    """What the provision Job does, as the admin, on the single-node NATS: the run's streams fit
    the account its run config gives it, which fits the server's store (or the server would not
    start). (The GPU cluster's replicated streams need its three servers.)"""
    objects = render("single-node")
    conf, identities = nats_files(objects, tmp_path)
    config = load_config(tmp_path / "run.toml")
    with nats_here(conf, find_nats_server()) as url:
        admin = identities[Principal.ADMIN]
        async with session(url, "k8s-provision", give_up_after=10, identity_file=admin) as nc:
            report = await provision_run(nc.jetstream(), config.run, config.provision)
    assert report.created and not report.unchanged


def named_config(objects: list[dict]) -> str:
    (cm,) = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("seamlessflow-config-")
    ]
    return cm["data"]["run.toml"]


def test_gpu_cluster_pools_are_apart():
    objects = render("gpu-cluster")
    pools = {}
    for kind, name in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
        pod = named(objects, kind, name)["spec"]["template"]["spec"]
        assert int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        pools[name] = pod["nodeSelector"]["seamlessflow.io/pool"]
    assert pools == {"trainer": "train", "rollout": "rollout"}


def test_a_trainer_group_is_a_worker_a_pod_on_one_checkpoint_volume(monkeypatch, tmp_path):
    """trainer-group: as many workers tagged train (alone: no engine) as the scheduler's train
    count, each its pod's name as its id, rendezvous at its pod's address, one GPU, and every
    member on one shared (ReadWriteMany) checkpoint volume, so whichever is rank 0 resumes."""
    objects = render("trainer-group")
    trainer = named(objects, "StatefulSet", "trainer")
    pod = trainer["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse(objects, container, monkeypatch)
    config = settings(objects, pod, args, tmp_path / "run.toml")
    assert args.command == "worker" and config.worker.worker_id == ENV_EXAMPLES["POD_NAME"]
    assert config.worker.tags == ["train", "node=gpu-node-7"] and config.worker.role == "train"
    assert config.trainer.world_size == 1  # one rank a member
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("valueFrom", {}) for e in container["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    (scheduler,) = named(objects, "Deployment", "scheduler")["spec"]["template"]["spec"][
        "containers"
    ]
    scheduling = parse(objects, scheduler, monkeypatch)
    placement = apply_flags(load_config(None), scheduling, scheduling.flags).layout.spec()
    assert placement.train.count == trainer["spec"]["replicas"] > 1
    assert "volumeClaimTemplates" not in trainer["spec"]
    mounts = container["volumeMounts"]
    (mount,) = [m for m in mounts if m["mountPath"] == str(config.trainer.checkpoint_dir)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = named(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_dashboards_are_one_configmap():
    objects = render("single-node")
    (cm,) = [o for o in objects if o["metadata"]["name"].startswith("seamlessflow-dashboards-")]
    shipped = {p.name for p in (ROOT / "dashboards" / "grafana").glob("*.json")}
    assert set(cm["data"]) == shipped
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
