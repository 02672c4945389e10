"""For benchmarks only: an engine that spends modelled time instead of computing.

It implements ``rollout.engines.base.Engine`` with the lengths and costs of a
``emulation.workload.Workload`` (``EmulatedEngineConfig.workload``), so that many rollout workers
fit on a few cores while the real worker, gateway, trajectory manager and scheduler run around
them with a cluster's timing. Its tokens mean nothing. The model, and its assumptions:

- **Continuous batching.** Up to ``engine.max_batch`` requests are resident and, with a KV budget
  (``engine.kv_tokens``), only while the residents hold fewer KV tokens than it, each its whole
  output length (as the cluster simulator models it); the others wait in order of arrival. Requests
  admitted into the batch first cost ``engine.prefill_s(prompt tokens)`` (a continuation's prompt
  holds its retained prefix: that is its re-prefill), serialised with decoding; then one decode
  iteration over ``b`` resident requests costs ``engine.iteration_s(b)`` and adds one token to each.
  Sleeps are paced against a deadline, so this process's own overhead does not add up (a lag of up
  to ``MAX_CATCH_UP_S`` is made up by sleeping less).
- **Lengths.** A request's total output length (EOS included) is one member's draw of
  ``lengths.sample_group(rng, group_size, version)`` (the lengths of the workload's phase at
  ``version``, ``Workload.at``; the phase's agent is the agent's business), ``rng`` seeded by its
  group, so a group shares the group part of its draw. A request with a sampling seed ``s`` is
  member ``s % group_size`` of group ``s // group_size`` (the benchmark agent numbers its requests
  so); one without is keyed by its prompt and takes a member drawn from the engine's seeded
  generator. ``version`` is the engine's version when the request arrives. The request ends with
  ``STOP`` at that length (the last token is EOS), or with ``LENGTH`` at ``max_tokens`` or
  ``max_model_len``.
- **Tokens.** Output token ``j`` is the id of the ``j % cycle``-th lowercase letter (from the
  model folder's ``tokenizer.json``), logprob ``-log(cycle)``. An output is thus
  self-describing: a prompt that ends with the first ``k`` tokens of an output is a
  continuation (the gateway resumes an aborted attempt so), which ends at the total length the
  interrupted attempt had drawn (when drawn from a seed, and at an unchanged version when
  lengths grow with it). Prompts must not end in such a run by themselves (chat templates end
  in a newline or a special token).
- **Streaming.** A request's new tokens go out every ``chunk_s`` of its time and at once when it
  ends, is aborted, the engine pauses or loads weights: a chunk carries one version.
- **Weights.** ``load_weights`` takes ``weight_load_s`` (default ``workload.weight_sync_s``),
  between two iterations, and reads nothing: the files are not checked.
"""

import asyncio
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from broker.messages import FinishReason, SamplingParams
from common.log import kv
from common.models import eos_token_ids, model_info
from emulation.config import EmulatedEngineConfig
from emulation.workload import EngineCost
from rollout.engines.base import (
    ENGINE_REQUESTS,
    ENGINE_WEIGHT_LOADS,
    EngineConfig,
    EngineError,
    GenerationChunk,
    InProcessEngine,
)

log = logging.getLogger(__name__)

ENGINE = "emulated"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_CATCH_UP_S = 1.0
"""At most this much lag behind the modelled clock is made up; beyond it the clock restarts."""


async def start(config: EngineConfig) -> "EmulatedEngine":
    """Read the model folder's vocabulary size, EOS and letter ids; start the scheduler."""
    settings = config.settings
    if not isinstance(settings, EmulatedEngineConfig):
        raise EngineError(f"the emulated engine was given a {settings.kind!r} config")
    letters, vocab, eos = await asyncio.to_thread(_vocabulary, config.model, settings.cycle)
    engine = EmulatedEngine(config, settings, letters, vocab, eos)
    log.info(
        kv(
            "emulated_engine_started",
            model=config.model,
            version=config.version,
            max_batch=settings.workload.engine.max_batch,
            median=settings.workload.lengths.median,
        )
    )
    return engine


def _vocabulary(model: Path, cycle: int) -> tuple[list[int], int, int]:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        vocab = int(model_info(model)["vocab_size"])
        eos = sorted(eos_token_ids(model))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise EngineError(f"cannot read the vocabulary of {model}: {exc}") from exc
    letters = [tokenizer.token_to_id(c) for c in LETTERS[:cycle]]
    if None in letters or not eos:
        raise EngineError(f"{model}: its tokenizer lacks single-letter tokens or it has no EOS")
    return letters, vocab, eos[0]


@dataclass(eq=False)
class _Request:
    """One request. ``resumed`` output tokens came in the prompt; ``length`` is its total
    output length drawn (resumed included); at most ``limit`` new tokens."""

    id: str
    prompt_tokens: int
    resumed: int
    length: int
    limit: int
    queue: asyncio.Queue[GenerationChunk] = field(default_factory=asyncio.Queue)
    produced: int = 0
    pending: list[int] = field(default_factory=list)
    last_sent: float = 0.0
    done: bool = False

    @property
    def kv_tokens(self) -> int:
        """The KV it holds resident: its whole output, as far as it may run."""
        return min(self.length, self.resumed + self.limit)


class EmulatedEngine(InProcessEngine):
    """Implements ``rollout.engines.base.Engine``; create it with ``start``."""

    name = ENGINE

    def __init__(
        self,
        config: EngineConfig,
        settings: EmulatedEngineConfig,
        letters: list[int],
        vocab_size: int,
        eos: int,
    ) -> None:
        super().__init__(config, vocab_size)
        self._settings = settings
        self._workload = settings.workload
        self._letters = letters
        self._position = {token: i for i, token in enumerate(letters)}
        self._logprob = -math.log(len(letters))
        self._eos = eos
        self._rng = random.Random(settings.seed)
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._resident: list[_Request] = []
        self._deadline: float | None = None
        self._scheduler = asyncio.create_task(self._schedule(), name="emulated-engine-scheduler")

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._send(request)
            self._release(request, FinishReason.ABORT)
            request.queue.put_nowait(GenerationChunk([], [], self._version, FinishReason.ABORT))

    async def pause(self) -> None:
        self._paused = True
        async with self._step_lock:  # the iteration in flight, if any, has finished
            self._send_all()

    async def load_weights(self, version: int, path: Path) -> None:
        self._check_loadable()
        seconds = self._settings.weight_load_s
        if seconds is None:
            seconds = self._workload.weight_sync_s
        async with self._step_lock:
            self._send_all()  # what the old version produced goes out labelled so
            await asyncio.sleep(seconds)
            self._version = version
            self._deadline = None
        ENGINE_WEIGHT_LOADS.labels(ENGINE, "loaded").inc()
        log.info(kv("emulated_weights_loaded", version=version, path=path, seconds=seconds))

    async def close(self) -> None:
        if not await self._shut():
            return
        log.info(kv("emulated_engine_closed", model=self._config.model))

    # -- requests -------------------------------------------------------------------------------

    def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> _Request:
        self._check_request(request_id, prompt_ids)
        resumed = self._resumed(prompt_ids)
        request = _Request(
            id=request_id,
            prompt_tokens=len(prompt_ids),
            resumed=resumed,
            length=self._draw_length(prompt_ids[: len(prompt_ids) - resumed], params.seed),
            limit=min(params.max_tokens, self._config.max_model_len - len(prompt_ids)),
        )
        self._requests[request_id] = request
        self._waiting.append(request)
        self._wake.set()
        return request

    def _resumed(self, prompt_ids: list[int]) -> int:
        """How many of this engine's output tokens end ``prompt_ids``: the longest trailing run
        that reads letter 0, 1, 2, ... (cyclically) up to the end."""
        cycle = len(self._letters)
        run = best = 0
        previous = 0
        for token in reversed(prompt_ids):
            i = self._position.get(token)
            if i is None or (run and i != (previous - 1) % cycle):
                break
            run, previous = run + 1, i
            if i == 0:
                best = run
        return best

    def _room(self, cost: EngineCost) -> bool:
        """Whether the batch takes another request: under ``max_batch`` residents and, with a KV
        budget, residents holding under ``kv_tokens`` (each its whole output length, as the
        cluster simulator models it)."""
        if len(self._resident) >= cost.max_batch:
            return False
        return not cost.kv_tokens or sum(r.kv_tokens for r in self._resident) < cost.kv_tokens

    def _draw_length(self, key: list[int], seed: int | None) -> int:
        """The total output length of a request: its member's draw of its group's lengths."""
        n = self._workload.group_size
        if seed is not None:
            group, member = divmod(seed, n)
            rng = random.Random(group)
        else:
            rng = random.Random(",".join(map(str, key)))
            member = self._rng.randrange(n)
        lengths = self._workload.at(self._version).lengths
        return lengths.sample_group(rng, n, self._version)[member]

    def _release(self, request: _Request, outcome: FinishReason) -> None:
        ENGINE_REQUESTS.labels(ENGINE, outcome.value).inc()
        request.done = True
        del self._requests[request.id]
        if request in self._resident:
            self._resident.remove(request)
        else:
            self._waiting.remove(request)

    # -- scheduling -----------------------------------------------------------------------------

    async def _schedule(self) -> None:
        cost = self._workload.engine
        while True:
            # 1. Sleep while paused or idle; the modelled clock restarts after.
            if self._paused or not self._requests:
                self._deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                # 2. Admit waiting requests into the batch; their prefill comes first.
                admitted = []
                while self._waiting and self._room(cost):
                    admitted.append(self._waiting.popleft())
                    self._resident.append(admitted[-1])
                if admitted:
                    await self._spend(cost.prefill_s(sum(r.prompt_tokens for r in admitted)))
                # 3. One decode iteration: a token for every resident request.
                batch = list(self._resident)
                await self._spend(cost.iteration_s(len(batch)))
                now = time.monotonic()
                for request in batch:
                    if not request.done:  # not aborted meanwhile
                        self._advance(request, now)

    async def _spend(self, seconds: float) -> None:
        now = time.monotonic()
        if self._deadline is None or self._deadline < now - MAX_CATCH_UP_S:
            self._deadline = now
        self._deadline += seconds
        await asyncio.sleep(max(0.0, self._deadline - now))

    def _advance(self, request: _Request, now: float) -> None:
        request.produced += 1
        position = request.resumed + request.produced - 1
        reason = None
        if position + 1 >= request.length:
            request.pending.append(self._eos)
            reason = FinishReason.STOP
        else:
            request.pending.append(self._letters[position % len(self._letters)])
            if request.produced >= request.limit:
                reason = FinishReason.LENGTH
        if reason is not None:
            self._send(request, reason)
            self._release(request, reason)
        elif now - request.last_sent >= self._settings.chunk_s:
            self._send(request)

    def _send(self, request: _Request, reason: FinishReason | None = None) -> None:
        """Stream ``request``'s pending tokens (and ``reason``, if it ends)."""
        if not request.pending and reason is None:
            return
        tokens, request.pending = request.pending, []
        chunk = GenerationChunk(tokens, [self._logprob] * len(tokens), self._version, reason)
        request.queue.put_nowait(chunk)
        request.last_sent = time.monotonic()

    def _send_all(self) -> None:
        for request in self._resident:
            self._send(request)
