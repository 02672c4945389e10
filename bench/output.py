"""Where every bench script writes its JSON results: ``bench/results/<name>``."""

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_results(name: str, result: dict) -> Path:
    """Write ``result`` as indented JSON to ``bench/results/<name>``; return that path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
