"""Every query in the dashboards parses, filters by the dashboard's run, job and instance
variables, and names only metrics that one kind of process exports together (checked against
the registries each process kind serves, not one merged registry)."""

import json
from pathlib import Path

import promql_parser
import pytest

import broker.metrics
import broker.roles
import rollout.agents.runner
import rollout.engines.base
import rollout.gateway
import rollout.metrics
import tagsched.metrics
import trainer.metrics
import trajectory.manager
from broker.metrics import StreamDepthCollector
from rollout.gateway.calls import REGISTRY as CALL_METRICS
from seamlessflow.targets import KINDS

DASHBOARDS = sorted((Path(__file__).parents[1] / "dashboards" / "grafana").glob("*.json"))

SERVED = {
    "broker": [StreamDepthCollector()],
    "worker": [
        rollout.metrics.REGISTRY,
        rollout.engines.base.REGISTRY,
        broker.metrics.REGISTRY,
        broker.roles.REGISTRY,
        trainer.metrics.REGISTRY,  # a worker tagged train holds a trainer too
    ],
    "gateway": [rollout.gateway.REGISTRY, CALL_METRICS],
    "trajectory": [trajectory.manager.REGISTRY, broker.metrics.REGISTRY],
    "trainer": [trainer.metrics.REGISTRY, broker.metrics.REGISTRY, broker.roles.REGISTRY],
    "agents": [rollout.agents.runner.REGISTRY, broker.metrics.REGISTRY],
    "scheduler": [tagsched.metrics.REGISTRY, broker.metrics.REGISTRY],
}
"""What each kind of process serves (besides process_/python_ metrics): the registries its
``serve_*`` function passes to ``common.metrics.serve_metrics`` (the most it may serve)."""

OWN_PREFIXES = {
    "broker": ("sf_broker_", "sf_stream_", "sf_consumer_"),
    "worker": ("sf_rollout_", "sf_engine_", "sf_ingress_", "sf_nats_", "sf_worker_", "sf_trainer_"),
    "gateway": ("sf_gateway_",),
    "trajectory": ("sf_trajectory_", "sf_ingress_", "sf_nats_"),
    "trainer": ("sf_trainer_", "sf_ingress_", "sf_nats_", "sf_worker_"),
    "agents": ("sf_agents_", "sf_ingress_", "sf_nats_"),
    "scheduler": ("sf_scheduler_", "sf_ingress_", "sf_nats_"),
}
"""The only ``sf_`` families each kind may export: its own part's, ``sf_ingress_`` and
``sf_nats_`` (operations tried again, ``broker.retry``) where it runs a validated ingress,
``sf_engine_`` for workers, ``sf_worker_`` (roles) for processes that hold a role, and
``sf_trainer_`` for workers that hold a trainer."""

BROKER_SERIES = OWN_PREFIXES["broker"]
"""Served by a broker, which can carry many runs: filtered by run through the stream name."""


def family_names(collectors) -> set[str]:
    """The sample names the collectors export (``_total``, ``_bucket``, ... included)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    names = set()
    for collector in collectors:
        for family in collector.collect():
            names.update(family.name + s for s in suffixes.get(family.type, [""]))
    return names


EXPORTED = {kind: family_names(parts) for kind, parts in SERVED.items()}


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target of a dashboard."""
    dashboard = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def query_kinds(expr: str) -> set[str]:
    """The process kinds whose series a query reads: those exporting every metric it names."""
    names = {s.name for s in selectors(promql_parser.parse(expr))}
    return {kind for kind, exported in EXPORTED.items() if names <= exported}


def selectors(expr) -> list:
    if isinstance(expr, promql_parser.VectorSelector):
        return [expr]
    found = []
    for attr in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(expr, attr, None)
        if child is not None:
            found += selectors(child)
    for arg in getattr(expr, "args", None) or ():
        found += selectors(arg)
    return found


def test_each_kind_exports_only_its_own_families():
    for kind, exported in EXPORTED.items():
        sf = {name for name in exported if name.startswith("sf_")}
        assert sf == exported, kind  # nothing but sf_ families in the parts' registries
        foreign = {n for n in sf if not n.startswith(OWN_PREFIXES[kind])}
        assert not foreign, f"{kind} exports {foreign}"
        assert any(n.startswith(OWN_PREFIXES[kind][0]) for n in sf), kind
    assert set(SERVED) == set(KINDS)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_has_run_job_and_instance_variables(path):
    variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
    assert {"datasource", "run", "job", "instance"} <= variables.keys()
    assert "run" in variables["run"]["definition"]
    for name in ("job", "instance"):  # several at once, or all
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert "$run" in variables[name]["definition"]
    # "All" means the jobs the variable lists, not every job of the Prometheus server
    assert f'job=~"{variables["job"]["allValue"]}"' in variables["job"]["definition"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_filter_and_read_one_kind_of_process(path):
    queries = dashboard_queries(path)
    assert queries
    for title, expr in queries:
        found = selectors(promql_parser.parse(expr))
        assert found, expr
        kinds = query_kinds(expr)
        assert kinds, f"{path.name} {title!r}: no process kind exports all of {expr}"
        for selector in found:
            matchers = {
                (m.name, str(m.op).rsplit(".", 1)[-1], m.value) for m in selector.matchers.matchers
            }
            assert ("job", "Re", "$job") in matchers, f"{title!r}: {selector} lacks job"
            assert ("instance", "Re", "$instance") in matchers, f"{title!r}: {selector}"
            if selector.name.startswith(BROKER_SERIES):
                by_stream = ("stream", "Re", "SF_${run}_.*") in matchers
                assert by_stream or selector.name == "sf_broker_up", f"{title!r}: {selector}"
            else:
                assert ("run", "Equal", "$run") in matchers, f"{title!r}: {selector} lacks run"


def test_every_kind_has_a_dashboard_query():
    covered = set()
    for path in DASHBOARDS:
        for _, expr in dashboard_queries(path):
            covered |= query_kinds(expr)
    assert covered == set(KINDS)
