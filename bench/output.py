"""What every bench script shares: where it writes its JSON results (``bench/results/<name>``),
the throwaway broker it runs on, and how it reads a percentile."""

import argparse
import json
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.machine import machine
from broker.config import EmbeddedBrokerConfig
from broker.server import EmbeddedBroker

RESULTS = Path(__file__).parent / "results"


def write_results(name: str, result: dict) -> Path:
    """Write ``result`` as indented JSON to ``bench/results/<name>``; return that path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def write_model_run(
    name: str, args: argparse.Namespace, model: Path, measured: dict, loadavg_before: float
) -> None:
    """Write a bench run on one model (the machine, its settings with the model's folder, what
    it measured) to ``bench/results/<name>`` and say where."""
    result = {
        "machine": machine(loadavg_before=loadavg_before),
        "settings": {**vars(args), "model_path": str(model)},
        **measured,
    }
    print(f"\nwrote {write_results(name, result)}")


@contextmanager
def bench_broker() -> Iterator[EmbeddedBroker]:
    """An embedded broker without auth, its store in a temporary folder removed afterwards."""
    with (
        tempfile.TemporaryDirectory() as state,
        EmbeddedBroker(EmbeddedBrokerConfig(state_dir=Path(state), insecure=True)) as broker,
    ):
        yield broker


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile of ``values``, interpolated within their range (q=50: the
    median); one value is every percentile of itself."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
