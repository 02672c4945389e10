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
  An engine that keeps its weights in the worker's own process (``TakesTensors``: hf) also
  loads them from tensors the process holds, with the same names and checks.
- ``close`` aborts what is in flight, then releases the engine; it never hangs.
"""

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter

from broker.messages import FinishReason, SamplingParams
from rollout.engines.config import EngineSettings, HFEngineConfig
from rollout.exceptions import EngineError

if TYPE_CHECKING:
    import torch

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

ENGINE_REQUESTS = Counter(
    "sf_engine_requests",
    "Generation requests by engine and outcome: stop, length, abort (aborted, closed, or the "
    "consumer left), error (generation failed), rejected (bad input, refused before generating)",
    ["engine", "outcome"],
    registry=REGISTRY,
)
ENGINE_PROMPT_TOKENS = Counter(
    "sf_engine_prompt_tokens",
    "Prompt tokens by engine and source: prefilled (KV computed; after a weight load, prompt + "
    "output again) or cached (KV reused from the engine's prefix cache: vLLM's whole blocks; "
    "hf's recent prompts and finished calls, a conversation's next turn reusing the last call)",
    ["engine", "source"],
    registry=REGISTRY,
)
ENGINE_WEIGHT_LOADS = Counter(
    "sf_engine_weight_loads",
    "Weight loads by engine and outcome: loaded, rejected (bad files, refused before touching "
    "the model; the old weights stay), failed (the engine raised while loading)",
    ["engine", "outcome"],
    registry=REGISTRY,
)


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

    async def sleep(self) -> None:
        """Hand the device's memory over (a colocated worker lent to training): paused
        (``EngineError`` otherwise), it aborts what still runs and frees what it holds on the
        device (KV cache; the weights kept in host memory) until ``wake``. Requests wait
        meanwhile; ``resume`` and ``load_weights`` are refused. An engine on a CPU has no device
        memory to free."""
        ...

    async def wake(self) -> None:
        """Take the memory back; paused still."""
        ...

    async def load_weights(self, version: int, path: Path) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class TakesTensors(Protocol):
    """An engine whose weights live in the worker's own process: it also loads a version from
    tensors the process holds (a colocated trainer's, ``rollout.following``), no file between."""

    async def load_tensors(self, version: int, tensors: "Mapping[str, torch.Tensor]") -> None:
        """``load_weights`` from ``tensors`` (HF names): read while it runs, never kept."""
        ...


def check_sleepable(engine: str, paused: bool) -> None:
    if not paused:
        raise EngineError(f"the {engine} engine sleeps only paused: pause it first")


def check_awake(engine: str, asleep: bool, doing: str) -> None:
    if asleep:
        raise EngineError(f"the {engine} engine is asleep: wake it before {doing}")


class InProcessEngine:
    """What the engines that schedule their own requests in this process (``hf``, and
    ``emulation.engine``'s) share: requests by id, each streaming the chunks put on its
    ``queue``; a scheduler task woken by ``_wake`` and held off by ``_paused``; checks of a
    request before it is admitted. A subclass sets ``name``, implements ``_admit`` (check, then
    register a request with ``queue`` and ``done``) and ``_release``, and starts its
    scheduler as ``_scheduler``."""

    name: ClassVar[str]
    _scheduler: asyncio.Task

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self._config = config
        self.vocab_size = vocab_size
        self._version = config.version
        self._requests: dict[str, Any] = {}
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._paused = False
        self._asleep = False
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return len(self._requests)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        request = self._admit(request_id, prompt_ids, params)
        try:
            while True:
                chunk = await request.queue.get()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if not request.done:  # the consumer left early
                self._release(request, FinishReason.ABORT)

    async def resume(self) -> None:
        check_awake(self.name, self._asleep, "resuming")
        self._paused = False
        self._wake.set()

    async def sleep(self) -> None:
        """(On a CPU: nothing to free.)"""
        if self._asleep:
            return
        check_sleepable(self.name, self._paused)
        for request_id in list(self._requests):
            await self.abort(request_id)
        self._asleep = True

    async def wake(self) -> None:
        self._asleep = False

    async def _shut(self) -> bool:
        """The first part of ``close``: abort every request, end the scheduler. False when
        the engine was closed already."""
        if self._closed:
            return False
        self._closed = True
        for request_id in list(self._requests):
            await self.abort(request_id)
        self._scheduler.cancel()
        await asyncio.wait([self._scheduler])
        return True

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Any:
        raise NotImplementedError

    def _release(self, request: Any, outcome: FinishReason) -> None:
        raise NotImplementedError

    def _check_request(self, request_id: str, prompt_ids: list[int]) -> None:
        """Refuse (``EngineError``, counted as rejected) a duplicate id, a prompt that is empty
        or leaves no room for a token, or a token outside the vocabulary."""
        try:
            self._check_open()
            if request_id in self._requests:
                raise EngineError(f"request {request_id!r} is already running")
            limit = self._config.max_model_len
            if not 0 < len(prompt_ids) < limit:
                raise EngineError(
                    f"request {request_id!r}: the prompt has {len(prompt_ids)} tokens; "
                    f"between 1 and {limit - 1} (max_model_len {limit} minus one) are allowed"
                )
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineError(
                    f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        except EngineError:
            ENGINE_REQUESTS.labels(self.name, "rejected").inc()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"the {self.name} engine is closed")

    def _check_loadable(self) -> None:
        self._check_open()
        check_awake(self.name, self._asleep, "loading weights")
