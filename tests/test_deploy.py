"""deploy/k8s: every overlay renders with kustomize, every object is valid against the Kubernetes
schemas (offline, kubernetes-validate's bundled ones), and the deployment's invariants hold:
each container runs a real ``seamlessflow`` subcommand whose flags parse and whose settings are
valid with the mounted run config, each part has a readiness probe and scrape annotations,
workers carry their node's tag, NATS is a 3-server cluster on the GPU cluster.
"""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from broker.server import find_nats_server
from seamlessflow.cli import build_parser
from seamlessflow.config import load_config
from seamlessflow.flags import apply_flags
from seamlessflow.targets import job_name

ROOT = Path(__file__).parents[1]
OVERLAYS = ("single-node", "gpu-cluster")
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against
PARTS = {"trajectory", "scheduler", "gateway", "agents", "trainer", "rollout"}
# What the downward API and the cluster put in $(VAR) references, for parsing the args.
ENV_EXAMPLES = {"NODE_NAME": "gpu-node-7", "POD_NAME": "rollout-6d5f9c7b8-x2k4q"}

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


def parse(objects: list[dict], container: dict, monkeypatch):
    """The container's args parsed as the pod parses them: in its environment (the envFrom
    ConfigMaps, e.g. SEAMLESSFLOW_NATS_URL, which --nats defaults to), $(VAR)s expanded."""
    for name in [n for n in os.environ if n.startswith("SEAMLESSFLOW_")]:
        monkeypatch.delenv(name)
    for source in container.get("envFrom", []):
        for key, value in named(objects, "ConfigMap", source["configMapRef"]["name"])[
            "data"
        ].items():
            monkeypatch.setenv(key, value)
    return build_parser().parse_args([expand(a, ENV_EXAMPLES) for a in container["args"]])


def test_every_container_runs_a_seamlessflow_command_that_parses(rendered, tmp_path, monkeypatch):
    overlay, objects = rendered
    commands = set()
    for obj in workloads(objects):
        pod = obj["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if not container["image"].startswith("ghcr.io/seamlessflow/seamlessflow:"):
                continue
            assert container["command"] == ["seamlessflow"], container["name"]
            defined = {e["name"] for e in container.get("env", [])}
            used = set(re.findall(r"\$\((\w+)\)", " ".join(container["args"])))
            assert used <= defined, f"{container['name']} uses undefined {used - defined}"
            args = parse(objects, container, monkeypatch)
            assert args.nats == "nats://nats:4222"
            commands.add(args.command)
            # The --config it names is the run config ConfigMap's file, and with the flags
            # applied the settings validate together, as the part itself checks at start.
            assert args.config == Path("/etc/seamlessflow/run.toml")
            volume = next(v for v in pod["volumes"] if v["name"] == "config")
            path = tmp_path / f"{obj['metadata']['name']}.toml"
            path.write_text(config_map(objects, volume)["data"]["run.toml"])
            if hasattr(args, "flags"):
                apply_flags(load_config(path), args, args.flags)
            else:
                load_config(path)
    assert commands == {
        "provision", "trajectory", "scheduler", "gateway", "agents", "trainer", "worker"
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


def nats_conf(objects: list[dict]) -> str:
    pod = named(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    return config_map(objects, volume)["data"]["nats.conf"]


def test_nats_is_a_jetstream_statefulset_with_storage(rendered, tmp_path):
    overlay, objects = rendered
    nats = named(objects, "StatefulSet", "nats")
    replicas = nats["spec"]["replicas"]
    assert replicas == {"single-node": 1, "gpu-cluster": 3}[overlay]
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    headless = named(objects, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    conf = nats_conf(objects)
    routes = re.findall(r"nats://(nats-\d+)\.nats-headless:6222", conf)
    assert routes == ([f"nats-{i}" for i in range(replicas)] if replicas > 1 else [])
    run = tomllib.loads(named_config(objects))
    assert run["provision"]["replicas"] == replicas  # streams replicated on every server
    # The server accepts the config (nats-server -t), with $POD_NAME as the pod gives it.
    path = tmp_path / "nats.conf"
    path.write_text(conf.replace("/data", str(tmp_path / "data")))
    check = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "POD_NAME": "nats-0"},
    )
    assert check.returncode == 0, check.stdout + check.stderr


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


def test_the_dashboards_are_one_configmap():
    objects = render("single-node")
    (cm,) = [o for o in objects if o["metadata"]["name"].startswith("seamlessflow-dashboards-")]
    shipped = {p.name for p in (ROOT / "dashboards" / "grafana").glob("*.json")}
    assert set(cm["data"]) == shipped
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
