"""Every query in the dashboards parses, and names only metrics SeamlessFlow exports."""

import json
from pathlib import Path

import promql_parser
import pytest

import broker.metrics
import rollout.agents.runner
import rollout.calls
import rollout.engines.base
import rollout.gateway
import rollout.worker
import trainer.service
import trajectory.manager
from broker.metrics import StreamDepthCollector

DASHBOARDS = sorted((Path(__file__).parents[1] / "dashboards" / "grafana").glob("*.json"))


def _exported() -> set[str]:
    names = set()
    parts = (broker.metrics, rollout.agents.runner, rollout.calls, rollout.engines.base)
    parts += (rollout.gateway, rollout.worker, trainer.service, trajectory.manager)
    families = [f for part in parts for f in part.REGISTRY.collect()]
    for family in [*families, *StreamDepthCollector().collect()]:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
    return names


def _selectors(expr) -> set[str]:
    if isinstance(expr, promql_parser.VectorSelector):
        return {expr.name}
    found = set()
    for attr in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(expr, attr, None)
        if child is not None:
            found |= _selectors(child)
    for arg in getattr(expr, "args", None) or ():
        found |= _selectors(arg)
    return found


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_parse_and_use_exported_metrics(path):
    dashboard = json.loads(path.read_text())
    exported = _exported()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        names = _selectors(promql_parser.parse(expr))
        assert names, expr
        assert names <= exported, f"{path.name}: {expr} uses {names - exported}"
