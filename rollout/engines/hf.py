"""The reference engine: a transformers causal LM (float32, or ``settings.dtype``) with a KV cache
per request, and a prefix cache (``_Prefixes``): the KV of recent prompts and of finished calls,
for the requests that start with them (a group's samples share their prompt; a conversation's
next turn starts with the last call's prompt and output; a weight load's recompute starts with
the prompt).

All torch work runs in one dedicated thread, so the event loop stays responsive. A scheduler task
steps every running request by one token per step (one forward per request, no padding, so a
request's numbers do not depend on what else runs), samples on the engine thread and pushes a
chunk per token into the request's queue. The step lock makes a step, a weight load and a pause
mutually exclusive: ``pause`` returns once it holds the lock, i.e. at a token boundary, and a
weight load swaps the parameters between two steps and drops every KV cache, so the next step
recomputes prompt + tokens so far with the new weights.
"""

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Cache

from broker.messages import FinishReason, SamplingParams
from common.log import kv
from common.models import eos_token_ids
from common.precision import unsupported
from rollout.engines.base import (
    ENGINE_PROMPT_TOKENS,
    ENGINE_REQUESTS,
    ENGINE_WEIGHT_LOADS,
    EngineConfig,
    GenerationChunk,
    InProcessEngine,
)
from rollout.exceptions import EngineError

log = logging.getLogger(__name__)

ENGINE = "hf"


GREEDY_BELOW = 1e-5
"""A temperature under this means greedy, as in vLLM."""


async def start(config: EngineConfig) -> "HFEngine":
    """Load ``config.model`` on the engine thread and start the scheduler."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
    try:
        model = await asyncio.get_running_loop().run_in_executor(executor, _load_model, config)
    except BaseException:
        executor.shutdown(wait=False)
        raise
    engine = HFEngine(config, model, executor)
    log.info(
        kv(
            "hf_engine_started",
            model=config.model,
            version=config.version,
            vocab=engine.vocab_size,
            max_model_len=config.max_model_len,
        )
    )
    return engine


def _load_model(config: EngineConfig) -> torch.nn.Module:
    """(Engine thread.)"""
    if config.settings.threads is not None:
        # Here, not in the caller: OpenMP takes a thread count per thread, so one set on the
        # event loop's thread does not reach this one.
        torch.set_num_threads(config.settings.threads)
    dtype = config.settings.dtype
    if why := unsupported(dtype, "cpu"):
        raise EngineError(f"engine dtype {dtype.value!r}: {why}")
    try:
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype.torch_dtype())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot load a causal LM from {config.model}: {exc}") from exc
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and config.max_model_len > limit:
        raise EngineError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings {limit}"
        )
    return model.eval()


@dataclass(eq=False)
class _Request:
    """One running request. ``cache`` holds the KV of the first ``cached`` tokens of
    ``prompt_ids + output_ids``; ``None`` after a weight load."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    queue: asyncio.Queue[GenerationChunk] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    cache: Cache | None = None
    cached: int = 0
    done: bool = False


class HFEngine(InProcessEngine):
    """Implements ``rollout.engines.base.Engine``; create it with ``start``."""

    name = ENGINE

    def __init__(
        self, config: EngineConfig, model: torch.nn.Module, executor: ThreadPoolExecutor
    ) -> None:
        super().__init__(config, model.get_input_embeddings().num_embeddings)
        self._model = model
        self._executor = executor
        self._eos_ids = eos_token_ids(config.model)
        self._shapes, self._aliases = _parameter_layout(model)
        self._requests: dict[str, _Request] = {}
        self._seeds = itertools.count(config.settings.seed)
        self._step_tokens: int = config.settings.step_tokens("cpu")  # set on a CPU, as hf runs
        self._prefixes = _Prefixes(config.settings.prefix_cache_bytes)  # engine thread only
        self._scheduler = asyncio.create_task(self._schedule(), name="hf-engine-scheduler")

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)

    async def pause(self) -> None:
        self._paused = True
        async with self._step_lock:  # the step in flight, if any, has finished
            pass

    async def load_weights(self, version: int, path: Path) -> None:
        await self._load(version, lambda: _read_safetensors(Path(path)), path)

    async def load_tensors(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        await self._load(version, lambda: tensors, "in_process")

    async def _load(
        self, version: int, read: Callable[[], Mapping[str, torch.Tensor]], source: object
    ) -> None:
        """Check what ``read`` gives against the model, then copy it in between two steps."""
        self._check_loadable()
        started = time.perf_counter()
        try:
            # Reading and checking (tied copies compared) are off the event loop.
            updates = await asyncio.to_thread(lambda: self._plan_update(read()))
        except EngineError as exc:
            ENGINE_WEIGHT_LOADS.labels(ENGINE, "rejected").inc()
            log.warning(kv("hf_weights_rejected", version=version, path=source, error=exc))
            raise
        async with self._step_lock:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._copy_weights, updates)
            except Exception as exc:  # e.g. closed meanwhile: the executor is shut down
                ENGINE_WEIGHT_LOADS.labels(ENGINE, "failed").inc()
                raise EngineError(f"loading weights version {version} failed: {exc!r}") from exc
            for request in self._requests.values():
                request.cache, request.cached = None, 0
            self._version = version
        ENGINE_WEIGHT_LOADS.labels(ENGINE, "loaded").inc()
        log.info(
            kv(
                "hf_weights_loaded",
                version=version,
                path=source,
                tensors=len(updates),
                running=len(self._requests),
                seconds=round(time.perf_counter() - started, 3),
            )
        )

    async def close(self) -> None:
        if not await self._shut():
            return
        # Lets the step in flight finish on the engine thread, then ends the thread.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        log.info(kv("hf_engine_closed", model=self._config.model))

    # -- requests -------------------------------------------------------------------------------

    def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> _Request:
        self._check_request(request_id, prompt_ids)
        seed = params.seed if params.seed is not None else next(self._seeds)
        request = _Request(
            id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            stop_ids=self._eos_ids | frozenset(params.stop_token_ids),
            generator=torch.Generator().manual_seed(seed),
        )
        self._requests[request_id] = request
        self._wake.set()
        return request

    def _release(self, request: _Request, outcome: FinishReason) -> None:
        ENGINE_REQUESTS.labels(ENGINE, outcome.value).inc()
        request.done = True
        request.cache = None
        del self._requests[request.id]

    # -- scheduling -----------------------------------------------------------------------------

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # 1. Sleep while paused or idle.
            if self._paused or not self._requests:
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                batch = list(self._requests.values())
                # 2. One token for every running request, on the engine thread.
                try:
                    sampled = await loop.run_in_executor(self._executor, self._step, batch)
                except Exception as exc:  # a torch failure ends this batch, not the engine
                    log.exception(kv("hf_step_failed", requests=len(batch), error=exc))
                    for request in batch:
                        self._finish(request, FinishReason.ERROR)
                    continue
                # 3. Stream the tokens; requests aborted meanwhile are skipped.
                for request, token in zip(batch, sampled, strict=True):
                    if token is not None and not request.done:
                        self._emit(request, *token)

    def _emit(self, request: _Request, token: int, logprob: float) -> None:
        reason = _ending(request, token, self._config.max_model_len)
        request.output_ids.append(token)
        request.queue.put_nowait(GenerationChunk([token], [logprob], self._version, reason))
        if reason is not None:
            self._release(request, reason)

    def _finish(self, request: _Request, reason: FinishReason) -> None:
        """End ``request`` with an empty last chunk."""
        if not request.done:
            self._release(request, reason)
            request.queue.put_nowait(GenerationChunk([], [], self._version, reason))

    # -- engine thread --------------------------------------------------------------------------

    def _step(self, batch: list[_Request]) -> list[tuple[int, float] | None]:
        """The next (token, logprob) of each request; ``None`` for one aborted before its turn
        (a lend aborts every request, then pauses: it waits for one forward, not the batch) or
        still prefilling (its prompt is longer than what the step's budget left it)."""
        with torch.inference_mode():
            return [
                None if request.done or not tokens else self._next_token(request, tokens)
                for request, tokens in zip(batch, self._chunks(batch), strict=True)
            ]

    def _chunks(self, batch: list[_Request]) -> list[int]:
        """Tokens each request computes this step. A decoding request computes its one; the
        ones prefilling share what is left of the step budget, oldest first (vLLM's chunked
        prefill), so a step, and a pause waiting for it, is bounded."""
        todo = [len(r.prompt_ids) + len(r.output_ids) - r.cached for r in batch]
        left = self._step_tokens - todo.count(1)
        chunks = []
        for tokens in todo:
            if tokens > 1:
                tokens = min(tokens, max(left, 0))
                left -= tokens
            chunks.append(tokens)
        return chunks

    def _next_token(self, request: _Request, tokens: int) -> tuple[int, float] | None:
        ids = request.prompt_ids + request.output_ids
        if request.cache is None:  # a new request, or one whose KV a weight load dropped
            request.cache, request.cached, logits = self._prefixes.take(ids)
            ENGINE_PROMPT_TOKENS.labels(ENGINE, "cached").inc(request.cached)
            ENGINE_PROMPT_TOKENS.labels(ENGINE, "prefilled").inc(len(ids) - request.cached)
            if logits is not None:  # all of ``ids``: the next token is drawn as the prompt's was
                return _sample(logits, request.params, request.generator)
        end = min(request.cached + tokens, len(ids))
        out = self._model(
            input_ids=torch.tensor([ids[request.cached : end]]),
            past_key_values=request.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        request.cache, request.cached = out.past_key_values, end
        logits = out.logits[0, -1].float()
        if end == len(request.prompt_ids):
            self._prefixes.put(request.prompt_ids, request.cache, logits, copy=True)
        if end < len(ids):
            return None  # the rest of the prompt in the next steps
        sampled = _sample(logits, request.params, request.generator)
        if _ending(request, sampled[0], self._config.max_model_len) is not None:
            # its last token: the KV of all before it, for the conversation's next turn
            self._prefixes.put(ids, request.cache, logits, copy=False)
        return sampled

    def _copy_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        state = self._model.state_dict()  # views of the parameters
        self._prefixes.clear()  # computed with the weights before
        with torch.no_grad():
            for name, value in updates:
                state[name].copy_(value)

    # -- weights --------------------------------------------------------------------------------

    def _plan_update(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Check ``tensors`` against the model: (parameter name, new value) per storage."""
        unknown = sorted(set(tensors) - set(self._shapes))
        if unknown:
            raise EngineError(f"unknown weights {unknown[:5]} ({len(unknown)} in all)")
        wrong = [
            f"{name} {tuple(t.shape)} != {self._shapes[name]}"
            for name, t in tensors.items()
            if tuple(t.shape) != self._shapes[name]
        ]
        if wrong:
            raise EngineError(f"weights of the wrong shape: {', '.join(wrong[:5])}")
        if ints := sorted(n for n, t in tensors.items() if not t.dtype.is_floating_point):
            raise EngineError(f"weights {ints[:5]} are not of a float dtype")
        updates, missing = [], []
        for names in self._aliases:
            given = [n for n in names if n in tensors]
            if not given:
                missing.append(names[0])
                continue
            if any(not torch.equal(tensors[n], tensors[given[0]]) for n in given[1:]):
                raise EngineError(f"tied weights {given} differ")
            updates.append((names[0], tensors[given[0]]))
        if missing:
            raise EngineError(f"missing weights {missing[:5]} ({len(missing)} in all)")
        return updates


def _ending(request: _Request, token: int, max_model_len: int) -> FinishReason | None:
    """How ``request`` ends if ``token`` is its next output token, if it does."""
    if token in request.stop_ids:
        return FinishReason.STOP
    length = len(request.output_ids) + 1
    if length >= request.params.max_tokens or len(request.prompt_ids) + length >= max_model_len:
        return FinishReason.LENGTH
    return None


class _Prefixes:
    """The KV of recent prompts, and of finished requests' prompt and output (all but the last
    token), each with the logits after it; least recently used first out past ``max_bytes``
    (engine thread only). A request whose ids start with stored ids starts from a copy of their
    KV, with the numbers their own prefill gave; one whose ids are stored ids draws its next
    token from the stored logits, as the request that stored them did."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[Cache, torch.Tensor, int]] = OrderedDict()
        self._bytes = 0

    def put(self, ids: list[int], cache: Cache, logits: torch.Tensor, *, copy: bool) -> None:
        """Keep ``cache``, the KV of exactly ``ids`` (a copy of it, for a request that goes on
        with it), and the ``logits`` of the token after them."""
        key = tuple(ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        size = _cache_bytes(cache) + logits.nbytes
        if size > self.max_bytes:
            return
        self._entries[key] = deepcopy(cache) if copy else cache, logits, size
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (*_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def take(self, ids: list[int]) -> tuple[Cache | None, int, torch.Tensor | None]:
        """A copy of the KV of the longest stored ids ``ids`` starts with, their length, and
        their logits if they are all of ``ids``; ``(None, 0, None)`` if none."""
        best: tuple[int, ...] = ()
        for key in self._entries:
            if len(best) < len(key) <= len(ids) and tuple(ids[: len(key)]) == key:
                best = key
        if not best:
            return None, 0, None
        self._entries.move_to_end(best)
        cache, logits, _ = self._entries[best]
        return deepcopy(cache), len(best), logits if len(best) == len(ids) else None

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


def _cache_bytes(cache: Cache) -> int:
    return sum(
        t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise EngineError(f"no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(file)
        except (OSError, SafetensorError) as exc:
            raise EngineError(f"cannot read {file}: {exc}") from exc
        if twice := sorted(set(part) & set(tensors)):
            raise EngineError(f"{file} repeats weights {twice[:5]}")
        tensors.update(part)
    return tensors


def _parameter_layout(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """Every state-dict name with its shape, and the names grouped by shared storage."""
    state = model.state_dict()
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    return {n: tuple(t.shape) for n, t in state.items()}, list(groups.values())


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """The next token and its logprob under the distribution it was drawn from. Greedy ignores
    top-k/top-p (they cannot change the argmax) and scores with plain ``log_softmax``, as vLLM."""
    if params.temperature < GREEDY_BELOW:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logprobs = torch.log_softmax(
        _top_k_top_p(logits / params.temperature, params.top_k, params.top_p), dim=-1
    )
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask all but the ``top_k`` largest logits (ties kept; ``top_k <= 0``: off), then all but
    the smallest set of most likely tokens holding ``top_p`` of the mass (as vLLM does)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ascending, order = logits.sort()
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[-1] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits
