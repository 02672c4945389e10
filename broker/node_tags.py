"""The tags a worker's node gives it: ``node=<name>`` and, where ``nvidia-smi`` answers,
``gpu=<model>`` (``NVIDIA H200`` -> ``gpu=h200``), so that ``[layout]`` demands can ask for
them without every launcher writing them into ``--tags``.

The user's own tags win: a worker configured with any ``node=...`` (``gpu=...``) gets no detected
``node=`` (``gpu=``) tag, so a launcher that knows better (Slurm's ``node=$SLURMD_NODENAME``)
or a user who wants a tag of their own choosing keeps it.

The GPU model is the node's: ``nvidia-smi`` lists every GPU of the node whatever the process
may use, so no count is tagged (it would be the node's, not the worker's share); a node with
several models gets a ``gpu=`` tag for each.
"""

import logging
import re
import shutil
import subprocess

from common.log import kv

log = logging.getLogger(__name__)

QUERY = ("--query-gpu=name", "--format=csv,noheader")
TIMEOUT_S = 10.0
_BRANDS = {"nvidia", "tesla", "geforce", "quadro"}
"""Words of a GPU's name that say who made or sells it, not which model it is."""
_SERIES = {"rtx", "gtx", "titan"}
"""Words that name a model only with the word after them (``RTX 4090`` -> ``rtx4090``)."""


def gpu_model(name: str) -> str | None:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA A100-SXM4-80GB`` -> ``a100``,
    ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``: lower case, the brand and the memory and form
    factor left out. ``None`` for a name with nothing else."""
    words = [w for w in re.split(r"[\s_-]+", name.strip().lower()) if w and w not in _BRANDS]
    if not words:
        return None
    if words[0] in _SERIES and len(words) > 1:
        return words[0] + words[1]
    return words[0]


def gpu_tags(query_output: str) -> list[str]:
    """``gpu=<model>`` for each model in ``nvidia-smi --query-gpu=name --format=csv,noheader``
    output (one GPU a line), in order of first appearance."""
    models = (gpu_model(line) for line in query_output.splitlines())
    return list(dict.fromkeys(f"gpu={m}" for m in models if m))


def query_gpus() -> str:
    """What ``nvidia-smi`` says of the node's GPUs; "" where it is absent or fails (no driver,
    no GPU): such a node has no ``gpu=`` tag, which is the truth as far as anyone can tell."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return ""
    try:
        done = subprocess.run(
            [binary, *QUERY], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning(kv("gpu_query_failed", error=f"{type(exc).__name__}: {exc}"))
        return ""
    if done.returncode != 0:
        log.warning(kv("gpu_query_failed", code=done.returncode, error=done.stderr.strip()[:200]))
        return ""
    return done.stdout


def with_node_tags(tags: list[str], node: str, gpus: str) -> list[str]:
    """``tags`` and the node's (``node``: its name; ``gpus``: ``query_gpus()``'s text), less
    any key the user's tags already give."""
    given = {t.split("=", 1)[0] for t in tags if "=" in t}
    detected = [f"node={node}", *gpu_tags(gpus)]
    return [*tags, *(t for t in detected if t.split("=", 1)[0] not in given and t not in tags)]
