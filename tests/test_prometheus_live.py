"""Metrics of a real run, end to end: ``seamlessflow run`` (embedded broker, trajectory manager,
trainer, rollout worker, gateway, agent runner) on the tiny model, its ``scrape_targets.json``,
each process's ``/metrics``, and a real Prometheus server scraping that file with the shipped
``dashboards/prometheus.yml``, which answers every query of every shipped dashboard."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from seamlessflow.processes import ServiceProcess
from seamlessflow.run import SCRAPE_TARGETS
from seamlessflow.targets import KINDS
from tests.support import free_port
from tests.test_dashboards import DASHBOARDS, OWN_PREFIXES, dashboard_queries, query_kinds

ROOT = Path(__file__).parents[1]
PROMETHEUS = shutil.which("prometheus") or next(
    (p for p in ("/usr/bin/prometheus",) if os.access(p, os.X_OK)), None
)
RUN = "live"
CONFIG = """
run = "{run}"
output_dir = "{out}"

[broker]
port = {nats_port}
metrics_port = {metrics_port}

[model]
name = "{model}"
max_model_len = 256
[model.warm_start]
steps = 0

[tasks]
group_size = 4
backlog = 4

[trainer]
groups_per_step = 1
checkpoint_dir = "{out}/checkpoints"  # so the checkpoint panel has data too...
checkpoint_every = 1                  # ... from the first versions

[stop]
max_steps = 1000
max_seconds = 3600  # the fixture stops the run; the tests' waits add up past 300 s

[provision]
weights_store_max_bytes = 50331648
""" + "".join(
    f"[provision.{part}]\nmax_bytes = 4194304\nmax_age_s = 3600.0\n"
    for part in ("tasks", "gen", "traj", "samples", "weights", "dead")
)


@dataclass
class LiveRun:
    proc: subprocess.Popen
    log: Path
    targets: Path
    metrics_key: Path
    """The gateway's /metrics key (``rollout.gateway.keys``), as the run wrote it."""
    nats_port: int
    metrics_port: int

    def output(self) -> str:
        return self.log.read_text()[-6000:]

    def groups(self) -> list[dict]:
        try:
            return json.loads(self.targets.read_text())
        except (OSError, json.JSONDecodeError):
            return []


def wait_for(condition, timeout: float, what: str, run: LiveRun) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.proc.poll() is None, f"the run exited while waiting for {what}:\n{run.output()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:g}s:\n{run.output()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LiveRun]:
    """``seamlessflow run`` on fixed broker ports, running until the module's tests are done,
    once every process is listed in its targets file."""
    tmp = tmp_path_factory.mktemp("live")
    out = tmp / "out"
    nats_port, metrics_port = free_port(), free_port()
    config = tmp / "run.toml"
    config.write_text(
        CONFIG.format(
            run=RUN, out=out, nats_port=nats_port, metrics_port=metrics_port, model=tiny_model_dir
        )
    )
    log = tmp / "run.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "seamlessflow.cli", "run", str(config)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    run = LiveRun(proc, log, out / SCRAPE_TARGETS, out / "metrics.key", nats_port, metrics_port)
    try:
        jobs = {f"seamlessflow-{kind}" for kind in KINDS}

        def listed() -> bool:
            return {g["labels"]["job"] for g in run.groups()} >= jobs

        wait_for(listed, 240, "target of every process kind", run)
        yield run
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, run.output()
    assert run.groups() == []  # the run is over: no targets left


def families(url: str, key: Path | None = None) -> dict[str, list]:
    """``{family name: samples}`` served at ``url`` now (sending the bearer key in ``key``)."""
    headers = {"Authorization": f"Bearer {key.read_text().strip()}"} if key else None
    body = httpx.get(url, timeout=10, headers=headers).raise_for_status().text
    return {f.name: f.samples for f in text_string_to_metric_families(body)}


def foreign_families(kind: str, exported: dict[str, list]) -> set[str]:
    """Families a process of ``kind`` must not export: another part's, or anything that is
    neither ``sf_`` nor the process/platform/GC metrics."""
    own = OWN_PREFIXES[kind]
    return {
        name
        for name in exported
        if not name.startswith(own) and not name.startswith(("process_", "python_"))
    }


def misfit_histograms(exported: dict[str, list]) -> list[str]:
    """Histograms whose observed mean lies below their lowest bucket bound (> 0) or above their
    highest finite bound: their quantiles say nothing."""
    misfits = []
    for name, samples in exported.items():
        bounds = sorted(
            {float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket"} - {math.inf}
        )
        total = sum(s.value for s in samples if s.name == f"{name}_sum")
        count = sum(s.value for s in samples if s.name == f"{name}_count")
        if not bounds or not count:
            continue
        mean = total / count
        if (bounds[0] > 0 and mean < bounds[0]) or mean > bounds[-1]:
            misfits.append(f"{name}: mean {mean:.3g} outside buckets {bounds[0]:g}..{bounds[-1]:g}")
    return misfits


@pytest.mark.newest_nats
@pytest.mark.timeout(420)
def test_every_process_exports_only_its_own_metrics(live_run: LiveRun, tmp_path: Path):
    groups = live_run.groups()
    broker = [g for g in groups if g["labels"]["job"] == "seamlessflow-broker"]
    assert broker[0]["targets"] == [f"127.0.0.1:{live_run.metrics_port}"]  # ports from config
    assert f"broker nats://127.0.0.1:{live_run.nats_port}" in live_run.output()
    assert all(g["labels"]["run"] == RUN for g in groups)

    # The standalone broker too (the run's is embedded in `seamlessflow run`).
    standalone = ServiceProcess("broker", "broker", "--state-dir", str(tmp_path / "broker"))
    processes = [(standalone.wait_ready(60).metrics_url, "broker")]
    try:
        for group in groups:
            kind = group["labels"]["job"].removeprefix("seamlessflow-")
            (address,) = group["targets"]
            processes.append((f"http://{address}{group['labels']['__metrics_path__']}", kind))
        assert sorted({kind for _, kind in processes}) == sorted(KINDS)
        # Wait for a trainer step, so the histograms below hold observations.
        trainer_url = next(url for url, kind in processes if kind == "trainer")

        def stepped() -> bool:
            return families(trainer_url)["sf_trainer_steps"][0].value >= 2

        wait_for(stepped, 180, "two trainer steps", live_run)
        problems = []
        gateway = next(url for url, kind in processes if kind == "gateway")
        assert httpx.get(gateway, timeout=10).status_code == 401  # the gateway's takes a key
        for url, kind in processes:
            exported = families(url, live_run.metrics_key if kind == "gateway" else None)
            if foreign := foreign_families(kind, exported):
                problems.append(f"{kind} ({url}) exports {sorted(foreign)}")
            if not any(name.startswith(OWN_PREFIXES[kind][0]) for name in exported):
                problems.append(f"{kind} ({url}) exports no {OWN_PREFIXES[kind][0]}* family")
            problems += [f"{kind}: {m}" for m in misfit_histograms(exported)]
        assert not problems, "\n".join(problems)
    finally:
        standalone.stop()


# -- a real Prometheus ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus(live_run: LiveRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server scraping the run every second through the shipped config, with the
    run's targets file linked where that config looks; its base URL."""
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (apt-get install prometheus): live dashboard check")
    home = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((ROOT / "dashboards" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["refresh_interval"] = "1s"
            for pattern in sd["files"]:
                link = home / pattern.replace("*", RUN)
                link.parent.mkdir(parents=True, exist_ok=True)
                if not link.is_symlink():
                    link.symlink_to(live_run.targets)
        if "authorization" in job:  # the gateway's job: the run's /metrics key
            link = home / job["authorization"]["credentials_file"]
            if not link.is_symlink():
                link.symlink_to(live_run.metrics_key)
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (home / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (home / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 30s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def query(prometheus: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = reply.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def substitute(expr: str, run: str, jobs: set[str]) -> str:
    """The query Grafana sends with these variables chosen (several jobs: a regex of them;
    every instance and every node)."""
    job = "seamlessflow-(" + "|".join(sorted(jobs)) + ")"
    expr = expr.replace("${run}", run).replace("$run", run)
    return expr.replace("$job", job).replace("$instance", ".*").replace("$node", ".*")


@pytest.mark.newest_nats
@pytest.mark.timeout(420)
def test_prometheus_answers_every_dashboard_query_from_the_right_job(
    live_run: LiveRun, prometheus: str
):
    up = f'up{{run="{RUN}"}} == 1'

    def ready() -> bool:
        return bool(
            len(query(prometheus, up)) == len(live_run.groups())
            and query(prometheus, f'sf_trainer_version{{run="{RUN}"}} >= 2')
            and query(prometheus, f'count_over_time(sf_trainer_version{{run="{RUN}"}}[1m]) >= 5')
        )

    wait_for(ready, 180, "every target up and two trainer steps scraped", live_run)
    scraped = {r["metric"]["job"] for r in query(prometheus, up)}
    assert scraped == {f"seamlessflow-{kind}" for kind in KINDS}

    problems = defaultdict(list)
    for path in DASHBOARDS:
        for title, expr in dashboard_queries(path):
            kinds = query_kinds(expr)
            mine = substitute(expr, RUN, kinds)
            result = query(prometheus, mine)
            if not result:
                problems[path.name].append(f"{title!r}: no data for {mine}")
            elif nan := [r for r in result if math.isnan(float(r["value"][1]))]:
                problems[path.name].append(f"{title!r}: NaN for {nan[0]['metric']}: {mine}")
            others = set(KINDS) - kinds
            if result := query(prometheus, substitute(expr, RUN, others)):
                problems[path.name].append(f"{title!r}: data from {sorted(others)}: {result}")
            elsewhere = substitute(expr, "nosuchrun", kinds)
            only_up = "sf_broker_up" in expr  # one broker carries many runs (see README)
            if not only_up and (result := query(prometheus, elsewhere)):
                problems[path.name].append(f"{title!r}: data for another run: {result}")
    assert not problems, json.dumps(problems, indent=1)
