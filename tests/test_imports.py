"""Imports run one way: common <- broker <- the services <- the CLI, and emulation (benchmark
and capacity-planning parts: plugins, never imported by the product).

Read statically (ast), every import statement anywhere in a module counts, lazy ones included:
a lazy import upward is still a dependency upward.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# A package may import its own layer's package and the layers below; services not each other.
LAYERS = {
    "common": 0,
    "broker": 1,
    "rollout": 2,
    "trainer": 2,
    "trajectory": 2,
    "tagsched": 2,
    "colocate": 3,
    "emulation": 3,
    "seamlessflow": 4,
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & LAYERS.keys()


def _violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for other in sorted(_imports(path) - {package}):
            if LAYERS[other] >= LAYERS[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {other}")
    return bad


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_package_imports_only_layers_below(package):
    assert _violations(package) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The check itself can fail: an upward import in a scratch copy of a package is reported.
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "x.py").write_text("def f():\n    from trainer.config import X\n")
    assert _violations("broker") == ["broker/x.py imports trainer"]
