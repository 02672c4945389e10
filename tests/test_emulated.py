"""The emulated engine and trainer backend (benchmarks only): the engine keeps the Engine contract
(lengths from the workload's sampler and max_tokens, abort, pause/resume, version labels,
continuations), both spend roughly the modelled time (loose bounds: this machine is shared),
both are plugins that say they are for benchmarks only, and a short ``seamlessflow run`` on them
completes through a real nats-server and says so in its summary."""

import asyncio
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from broker.messages import FinishReason, SamplingParams
from common.log import kv
from emulation.config import EmulatedBackendConfig, EmulatedEngineConfig
from emulation.workload import LengthModel, Phase, Workload
from rollout.engines import ENGINE_CONFIGS, EngineConfig, EngineError, HFEngineConfig, start_engine
from trainer.backends import TokenBatch, build_backend
from trainer.config import BACKEND_CONFIGS, TorchBackendConfig, TrainerConfig

WORKLOAD = Workload.from_dict(
    {
        "lengths": {"median": 20, "sigma": 0.8, "cap": 60},
        "engine": {"a_s": 0.004, "b_s": 0.0005, "prefill_s_per_token": 1e-4, "max_batch": 4},
        "trainer": {"a_s": 0.2, "s_per_token": 1e-3},
        "weight_sync_s": 0.2,
        "group_size": 4,
    }
)
PROMPT = [40, 41, 42, 10]
"""Any prompt that does not end in a run of the engine's letters."""


async def emulated(tiny_model_dir: Path, workload: Workload = WORKLOAD):
    settings = EmulatedEngineConfig(workload=workload, chunk_s=0.0)
    return await start_engine(EngineConfig(tiny_model_dir, max_model_len=256, settings=settings))


@pytest.fixture
async def engine(tiny_model_dir: Path):
    engine = await emulated(tiny_model_dir)
    yield engine
    await engine.close()


async def collect(engine, request_id: str, prompt: list[int], params: SamplingParams):
    chunks = [c async for c in engine.generate(request_id, prompt, params)]
    return [t for c in chunks for t in c.token_ids], chunks


def drawn(seed: int, version: int = 0) -> int:
    group, member = divmod(seed, WORKLOAD.group_size)
    return WORKLOAD.lengths.sample_group(random.Random(group), WORKLOAD.group_size, version)[member]


async def test_lengths_follow_the_group_draw_and_max_tokens(engine):
    seeds = range(8, 16)  # groups 2 and 3, four members each
    results = await asyncio.gather(
        *(collect(engine, f"r{s}", PROMPT, SamplingParams(max_tokens=100, seed=s)) for s in seeds)
    )
    for seed, (ids, chunks) in zip(seeds, results, strict=True):
        assert len(ids) == drawn(seed)
        assert chunks[-1].finish_reason is FinishReason.STOP
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    long = next(s for s in range(100) if drawn(s) > 10)
    ids, chunks = await collect(engine, "capped", PROMPT, SamplingParams(max_tokens=5, seed=long))
    assert len(ids) == 5 and chunks[-1].finish_reason is FinishReason.LENGTH
    assert engine.num_running == 0
    with pytest.raises(EngineError):
        await collect(engine, "bad", [10**6], SamplingParams())


async def test_abort_ends_the_stream_and_a_continuation_keeps_the_drawn_length(engine):
    seed = next(s for s in range(100) if drawn(s) > 30)
    params = SamplingParams(max_tokens=100, seed=seed)
    got: list[int] = []
    stream = engine.generate("a", PROMPT, params)
    async for chunk in stream:
        got += chunk.token_ids
        if len(got) >= 10:
            await engine.abort("a")
        if chunk.finish_reason is not None:
            break
    assert chunk.finish_reason is FinishReason.ABORT
    assert 10 <= len(got) < drawn(seed)
    assert engine.num_running == 0
    await engine.abort("a")  # finished: a no-op
    # The gateway continues it so: prompt + tokens so far, the rest of max_tokens.
    rest, _ = await collect(
        engine, "a-1", PROMPT + got, SamplingParams(max_tokens=100 - len(got), seed=seed)
    )
    whole, _ = await collect(engine, "b", PROMPT, params)
    assert got + rest == whole and len(whole) == drawn(seed)


async def test_pause_holds_tokens_and_resume_continues_where_it_stopped(engine):
    seed = next(s for s in range(100) if drawn(s) > 30)
    params = SamplingParams(max_tokens=100, seed=seed)
    whole, _ = await collect(engine, "whole", PROMPT, params)
    got: list[int] = []

    async def consume() -> None:
        async for chunk in engine.generate("p", PROMPT, params):
            got.extend(chunk.token_ids)

    task = asyncio.create_task(consume())
    while len(got) < 5:
        await asyncio.sleep(0.005)
    await engine.pause()
    await asyncio.sleep(0.01)
    held = len(got)
    await asyncio.sleep(0.2)
    assert len(got) == held and 0 < held < len(whole)  # nothing while paused, output kept
    assert engine.num_running == 1
    await engine.resume()
    await asyncio.wait_for(task, 10)
    assert got == whole


async def test_load_weights_takes_its_time_and_relabels_the_rest(engine, tmp_path):
    seed = next(s for s in range(100) if drawn(s) > 30)
    chunks = []

    async def consume() -> None:
        async for chunk in engine.generate("w", PROMPT, SamplingParams(max_tokens=100, seed=seed)):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    while sum(len(c.token_ids) for c in chunks) < 5:
        await asyncio.sleep(0.005)
    started = time.monotonic()
    await engine.load_weights(3, tmp_path)
    assert WORKLOAD.weight_sync_s <= time.monotonic() - started < 4 * WORKLOAD.weight_sync_s
    await asyncio.wait_for(task, 10)
    assert engine.version == 3
    versions = [c.version for c in chunks if c.token_ids]
    assert versions[0] == 0 and versions[-1] == 3 and versions == sorted(versions)


@pytest.mark.parametrize(("kv_tokens", "together"), [(0, 4), (1, 1), (75, 2)])
async def test_a_kv_budget_keeps_fewer_requests_resident(tiny_model_dir, kv_tokens, together):
    """4 requests of 40 tokens each: all 4 run together on the 4 slots; with a KV budget of 1
    token one at a time (a resident holds its whole length), with 75 two (the second makes 80)."""
    cost = dataclasses.replace(WORKLOAD.engine, kv_tokens=kv_tokens)
    lengths = LengthModel(median=40, sigma=0.0, cap=60)
    engine = await emulated(
        tiny_model_dir, dataclasses.replace(WORKLOAD, engine=cost, lengths=lengths)
    )
    spans: dict[int, list[float]] = {}

    async def run(seed: int) -> None:
        params = SamplingParams(max_tokens=100, seed=seed)
        async for chunk in engine.generate(f"k{seed}", PROMPT, params):
            if chunk.token_ids:
                spans.setdefault(seed, []).append(time.monotonic())

    try:
        await asyncio.gather(*(run(s) for s in range(4)))
    finally:
        await engine.close()
    intervals = [(times[0], times[-1]) for times in spans.values()]
    overlap = max(sum(a <= t <= b for a, b in intervals) for t, _ in intervals)
    assert overlap == together


async def test_lengths_follow_the_phase_of_the_engines_version(tiny_model_dir, tmp_path):
    short = Phase(from_step=2, lengths=LengthModel(median=4, sigma=0.0, cap=4))
    engine = await emulated(tiny_model_dir, dataclasses.replace(WORKLOAD, phases=(short,)))
    try:
        seed = next(s for s in range(100) if drawn(s) > 10)
        params = SamplingParams(max_tokens=100, seed=seed)
        before, _ = await collect(engine, "p0", PROMPT, params)
        await engine.load_weights(2, tmp_path)
        after, _ = await collect(engine, "p1", PROMPT, params)
    finally:
        await engine.close()
    assert len(before) == drawn(seed) > 10 and len(after) == 4


async def test_time_follows_the_cost_model(engine):
    """A batch of 8 requests on 4 slots: the modelled time, replayed here, within 2x."""
    seeds = range(8)
    lengths = [drawn(s) for s in seeds]
    cost = WORKLOAD.engine
    expected, resident, waiting = 0.0, [], list(lengths)
    while resident or waiting:
        admitted = waiting[: cost.max_batch - len(resident)]
        waiting = waiting[len(admitted) :]
        expected += cost.prefill_s(len(PROMPT) * len(admitted))
        resident = [n - 1 for n in resident + admitted]
        expected += cost.iteration_s(len(resident) + resident.count(0))
        resident = [n for n in resident if n > 0]
    started = time.monotonic()
    await asyncio.gather(
        *(collect(engine, f"t{s}", PROMPT, SamplingParams(max_tokens=100, seed=s)) for s in seeds)
    )
    took = time.monotonic() - started
    assert expected / 1.25 <= took <= 2 * expected, (took, expected)


def test_trainer_backend_sleeps_the_step_and_publishes_a_small_blob(tmp_path):
    """The per-token part is over the loss tokens (``read``), as the simulator and the plan
    count a step's cost: a prompt of 30 tokens and 10 sampled ones cost 10."""
    workload = Workload.from_dict({"trainer": {"a_s": 0.1, "s_per_token": 5e-3}})
    backend_config = EmulatedBackendConfig(workload=workload, weight_floats=64)
    backend = build_backend(tmp_path, TrainerConfig(backend=backend_config))
    rows, width, prompt = 3, 40, 30
    batch = TokenBatch(
        input_ids=torch.ones(rows, width, dtype=torch.long),
        position_ids=torch.arange(width).repeat(rows, 1),
        attention_mask=torch.ones(rows, width, dtype=torch.long),
        read=(torch.arange(width) >= prompt).repeat(rows, 1),
    )
    started = time.monotonic()
    logp = backend.token_logprobs(batch, grad=True)  # the per-token part
    forward = time.monotonic() - started
    assert logp.shape == (rows, width) and logp.requires_grad
    assert (logp[:, 0] == 0).all() and (logp[:, 1:] < 0).all()
    stats = backend.apply(-logp.sum() / logp.numel())  # the fixed part
    took = time.monotonic() - started
    sampled = rows * (width - prompt)
    expected = workload.trainer.step_s(sampled)
    assert expected <= took < expected + 0.3  # every token's cost would be 0.45 s more
    assert workload.trainer.step_s(sampled) - workload.trainer.step_s(0) <= forward < 0.45
    assert stats.grad_norm > 0
    assert list(backend.hf_state_dict()) == ["emulated.weight"]
    assert backend.hf_state_dict()["emulated.weight"].numel() == 64
    with pytest.raises(ValueError, match="lengthz"):
        EmulatedBackendConfig(workload={"lengthz": {}})
    assert EmulatedEngineConfig(workload=json.dumps({"seed": 3})).workload.seed == 3


async def test_the_emulated_parts_are_plugins_that_announce_themselves_first(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Their configs join the kinds through entry points; starting one logs a benchmark_only
    WARNING before anything else; the product's parts log none."""
    assert ENGINE_CONFIGS["emulated"] is EmulatedEngineConfig
    assert BACKEND_CONFIGS["emulated"] is EmulatedBackendConfig
    assert not HFEngineConfig.benchmark_only and not TorchBackendConfig.benchmark_only
    caplog.set_level(logging.INFO)
    settings = EmulatedEngineConfig(workload=WORKLOAD)
    engine = await start_engine(EngineConfig(tiny_model_dir, max_model_len=256, settings=settings))
    await engine.close()
    build_backend(tmp_path, TrainerConfig(backend=EmulatedBackendConfig(workload=WORKLOAD)))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == announced("engine", EmulatedEngineConfig)
    assert announced("trainer backend", EmulatedBackendConfig) in lines


def announced(part: str, config: type) -> tuple[int, str]:
    return logging.WARNING, kv(
        "benchmark_only", part=part, kind="emulated", note=config.benchmark_only
    )


RUN = """
run = "{run}"
output_dir = "{out}"
[model.warm_start]
steps = 0
[rollout]
workers = 2
[cpus]
placement = "none"
[worker.engine]
kind = "emulated"
workload = {{ lengths = {{ median = 6, cap = 16 }}, engine = {{ a_s = 0.01 }} }}
[trainer]
groups_per_step = 2
max_staleness = 1
overlap = {overlap}
[trainer.backend]
kind = "emulated"
workload = {{ trainer = {{ a_s = 0.2 }} }}
[tasks]
group_size = 4
max_tokens = 16
backlog = 4
[layout]
kind = "{layout}"
train = {{ count = {trainers} }}
[stop]
max_steps = 3
max_seconds = 60
[provision]
weights_store_max_bytes = 50331648
tasks = {{ max_bytes = 4194304, max_age_s = 3600.0 }}
gen = {{ max_bytes = 4194304, max_age_s = 3600.0 }}
traj = {{ max_bytes = 4194304, max_age_s = 3600.0 }}
samples = {{ max_bytes = 4194304, max_age_s = 3600.0 }}
weights = {{ max_bytes = 4194304, max_age_s = 3600.0 }}
dead = {{ max_bytes = 4194304, max_age_s = 3600.0 }}
"""


@pytest.mark.newest_nats
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("layout", "overlap", "trainers"),
    [
        ("multiplexed", "false", 1),
        ("multiplexed", "true", 1),
        ("multiplexed", "false", 2),
        ("disaggregated", "false", 2),
    ],
    ids=["by-step", "overlap", "trainer-group", "disaggregated-trainer-group"],
)
def test_a_run_on_the_emulated_engine_and_trainer_completes(
    broker, run_name, tmp_path, layout, overlap, trainers
):
    """The whole run (multiplexed: the trainer's worker lent and reclaimed), with the trainer
    computing each step ahead (``trainer.overlap``), and with a trainer group of two workers
    (``[layout.train] count``) that ``seamlessflow run`` starts (disaggregated: workers tagged
    ``train`` only, which start no engine)."""
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(
        RUN.format(run=run_name, out=out, layout=layout, overlap=overlap, trainers=trainers)
    )
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "run", str(config), "--nats", broker.url],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 3  # the trainer may step once more while the run stops
    assert summary["trainer"]["samples trained"] >= 3 * 2 * 4
    assert summary["generated_tokens"] > 0
    assert summary["benchmark_only"] == {
        "engine emulated": EmulatedEngineConfig.benchmark_only,
        "trainer backend emulated": EmulatedBackendConfig.benchmark_only,
    }
    assert "benchmark only: engine emulated" in done.stdout
    # ``seamlessflow run`` started the trainer's workers (one trainer group) and, by step, the
    # scheduler lent them while they waited.
    (parts,) = summary["nodes"].values()
    assert len([p for p in parts if p.startswith("worker trainer-")]) == trainers, parts
    assert summary["costs"]["trainer workers"] == trainers
    if layout == "multiplexed":
        if overlap == "false":
            assert summary["scheduler"]["lends"] >= trainers
    else:  # only the rollout workers' engines loaded the versions: the trainer's have none
        assert summary["scheduler"]["lends"] == 0
        assert 0 < summary["rollout"]["weight loads"] <= 2 * summary["steps"]
