"""The engine interface every rollout engine implements, and the chunk it streams.

An engine turns token ids into a stream of sampled token ids with their logprobs. It never sees
text: tokenizing and chat templates belong to the gateway. Contract (checked for every engine by
``tests/engine_contract.py``):

- ``generate`` streams ``GenerationChunk``s; the last one has a ``finish_reason``. A stop token
  (any of ``params.stop_token_ids`` or the model's EOS) is included in the output and ends the
  request with ``STOP``; ``max_tokens`` reached ends it with ``LENGTH``.
- ``logprobs[i]`` is the logprob of ``token_ids[i]`` under the distribution actually sampled from:
  ``log_softmax(logits / temperature)`` (plain ``log_softmax(logits)`` when temperature is 0,
  which means greedy), with top-k/top-p applied when given.
- Every chunk carries the weight ``version`` that produced its tokens.
- ``abort`` ends that request's stream at once with ``ABORT`` and frees it (``num_running``
  drops); aborting an unknown or finished request is a no-op.
  Greedy ignores top-k/top-p and scores with plain ``log_softmax(logits)``, as vLLM does.
- ``pause`` returns once no token is being produced (a token boundary); in-flight requests wait.
  ``resume`` continues them exactly where they stopped: with unchanged weights the output is the
  same as an uninterrupted run; after ``load_weights`` the rest is produced by the new weights
  from prompt + tokens so far.
- ``load_weights(version, path)``: ``path`` is a folder holding ``*.safetensors`` with HF
  parameter names (tied embeddings: ``lm_head.weight`` may be absent). Works paused or not.
- ``close`` aborts what is in flight, then releases the engine; it never hangs.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from broker.messages import FinishReason, SamplingParams
from common.exceptions import SeamlessFlowError
from rollout.engines.config import EngineSettings, HFEngineConfig

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

ENGINE_REQUESTS = Counter(
    "sf_engine_requests",
    "Generation requests by engine and outcome: stop, length, abort (aborted, closed, or the "
    "consumer left), error (generation failed), rejected (bad input, refused before generating)",
    ["engine", "outcome"],
    registry=REGISTRY,
)
ENGINE_WEIGHT_LOADS = Counter(
    "sf_engine_weight_loads",
    "Weight loads by engine and outcome: loaded, rejected (bad files, refused before touching "
    "the model; the old weights stay), failed (the engine raised while loading)",
    ["engine", "outcome"],
    registry=REGISTRY,
)


class EngineError(SeamlessFlowError):
    """An engine failed to start, generate or load weights."""


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request, all produced by weight ``version``."""

    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class EngineConfig:
    """What every engine needs to start."""

    model: Path
    """An HF model folder (config.json, *.safetensors, tokenizer files)."""
    max_model_len: int
    """Prompt plus output tokens, at most."""
    version: int = 0
    """The version the weights in ``model`` are."""
    settings: EngineSettings = field(default_factory=HFEngineConfig)
    """Which engine (``settings.kind``) and its own options."""


class Engine(Protocol):
    """A running inference engine. Methods are called from one asyncio event loop."""

    @property
    def version(self) -> int:
        """The weight version loaded now."""
        ...

    @property
    def num_running(self) -> int:
        """Requests started and not yet finished or aborted."""
        ...

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, version: int, path: Path) -> None: ...

    async def close(self) -> None: ...
