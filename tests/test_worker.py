"""The rollout worker as a real subprocess (hf engine, tiny model) on a real nats-server."""

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import rollout.worker
from broker import codec
from broker.messages import (
    FinishReason,
    GenerationCancelled,
    GenerationRequested,
    MessageRejected,
    Role,
    SamplingParams,
    TokensGenerated,
    WeightsPublished,
    WeightsState,
)
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.registry import watch_workers
from broker.subjects import Durable, RunNames
from broker.weights import LOCAL_BLOB, announce_local, host_id, local_folder, publish_weights
from rollout.engines import EngineConfig, HFEngineConfig, start_engine
from rollout.exceptions import EngineError
from rollout.metrics import REGISTRY as ROLLOUT_METRICS
from rollout.worker import RolloutWorker
from rollout.worker_config import WorkerConfig
from seamlessflow.processes import worker_process
from tests.support import (
    SMALL_RUN,
    eventually,
    greedy,
    metric,
    perturbed_weights,
    registered,
    stream_messages,
)

pytestmark = pytest.mark.newest_nats

PROMPT = [1, 383, 201, 74, 75, 2, 201, 1, 382, 201]


class Call:
    """Publishes one GenerationRequested and collects its chunks, as a gateway would."""

    def __init__(self, nc, names: RunNames, call_id: str, streamed: bool = True, **params) -> None:
        self.nc, self.names, self.call_id, self.streamed = nc, names, call_id, streamed
        self.params = SamplingParams(**params)
        self.chunks: list[TokensGenerated] = []
        self.done = asyncio.Event()

    async def start(self, prompt: list[int] = PROMPT) -> "Call":
        async def on_chunk(msg) -> None:
            chunk = codec.decode(TokensGenerated, msg.data)
            self.chunks.append(chunk)
            if chunk.finish_reason is not None:
                self.done.set()

        self.sub = await self.nc.subscribe(self.names.gen_out(self.call_id), cb=on_chunk)
        request = GenerationRequested(
            call_id=self.call_id,
            session_id="s1",
            model="tiny",
            prompt_ids=prompt,
            params=self.params,
            reply_to=self.names.gen_out(self.call_id),
            streamed=self.streamed,
        )
        await self.nc.jetstream().publish(self.names.gen_req, codec.encode(request))
        return self

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    async def finished(self, timeout: float = 60) -> TokensGenerated:
        await asyncio.wait_for(self.done.wait(), timeout)
        await self.sub.unsubscribe()
        return self.chunks[-1]


@pytest.fixture
def worker(broker, names: RunNames, tiny_model_dir: Path):
    # The model's own context (2048), as the requests below assume; [model]'s default is 512.
    # Tokens are held up to 50 ms (default 10 ms), so chunks hold several even on a slow machine.
    args = ("--max-running", "4", "--max-model-len", "2048", "--stream-interval-s", "0.05")
    proc = worker_process(broker.url, names.run, tiny_model_dir, "w1", *args)
    yield proc.wait_ready()
    proc.stop()


async def test_worker_streams_token_exact_chunks_and_acks(worker, nc, js, names, tiny_model_dir):
    entry = await registered(js, names, "w1")
    assert entry is not None and entry.role == "rollout" and entry.version == 0
    assert entry.tags == ["rollout", f"node={entry.host}"]  # its config's and its node's
    assert entry.metrics_url == worker.metrics_url

    sent = time.monotonic()
    call = await Call(nc, names, "c1", max_tokens=12, temperature=0).start()
    last = await call.finished()
    took = time.monotonic() - sent
    assert [c.seq for c in call.chunks] == list(range(len(call.chunks)))
    # The engine's seconds come on the last chunk only, within the call as seen from here.
    assert 0 < last.engine_s < took
    assert [c.engine_s for c in call.chunks[:-1]] == [None] * (len(call.chunks) - 1)
    assert call.chunks[0].token_ids == []  # "started", sent before the first token
    assert last.finish_reason is FinishReason.LENGTH and last.error is None
    assert {c.worker_id for c in call.chunks} == {"w1"} and {c.version for c in call.chunks} == {0}
    assert call.tokens == greedy(tiny_model_dir, PROMPT, 12)
    assert all(lp <= 0 for c in call.chunks for lp in c.logprobs)
    # Acknowledged when done: the work queue is empty.
    await eventually(lambda: _stream_empty(js, names.gen_stream))
    assert await metric(worker.metrics_url, "sf_rollout_tokens_total") >= 12

    # A malformed request is dead-lettered; the worker keeps serving.
    await js.publish(names.gen_req, b"\x93not a request")
    await eventually(lambda: _stream_has(js, names.dead_stream, 1))
    (dead,) = await stream_messages(js, names.dead_stream, MessageRejected)
    assert dead.source == "gen" and dead.payload == b"\x93not a request"
    again = await Call(nc, names, "c2", max_tokens=3, temperature=0).start()
    assert (await again.finished()).finish_reason is FinishReason.LENGTH


async def test_tokens_travel_in_few_chunks_and_reassemble_exactly(
    broker, worker, nc, js, names, tiny_model_dir
):
    """Tokens made within stream_interval_s of the last ones sent share a chunk: far fewer
    messages than tokens, the same tokens and logprobs in the same order as one per step."""
    call = await Call(nc, names, "c1", max_tokens=60, temperature=0).start()
    await call.finished()
    assert call.tokens == greedy(tiny_model_dir, PROMPT, 60)
    assert [c.seq for c in call.chunks] == list(range(len(call.chunks)))
    assert len(call.chunks[1].token_ids) == 1  # the first token is not held back
    assert len(call.chunks) < 60 and max(len(c.token_ids) for c in call.chunks) > 1
    assert all(len(c.logprobs) == len(c.token_ids) for c in call.chunks)

    # With stream_interval_s = 0 a worker sends a chunk per engine step: the same tokens.
    stepwise = worker_process(
        broker.url,
        names.run,
        tiny_model_dir,
        "w2",
        "--max-running",
        "4",
        "--max-model-len",
        "2048",
        "--stream-interval-s",
        "0",
    )
    worker.stop()  # only w2 takes the next request
    try:
        stepwise.wait_ready()
        again = await Call(nc, names, "c2", max_tokens=60, temperature=0).start()
        await again.finished()
        assert [len(c.token_ids) for c in again.chunks] == [0] + [1] * 60
        assert again.tokens == call.tokens
        logprobs = [lp for c in call.chunks for lp in c.logprobs]
        assert [lp for c in again.chunks for lp in c.logprobs] == pytest.approx(logprobs)
    finally:
        stepwise.stop()


async def test_a_request_not_streamed_is_held_until_its_end_or_the_keepalive(
    broker, nc, names, tiny_model_dir
):
    """Tokens of a request not ``streamed`` wait for the finish; the keepalive (0.3 s here)
    carries what is held meanwhile, instead of an empty chunk. The same request streamed (every
    50 ms) takes many more messages for the same tokens."""
    args = ("--max-model-len", "2048", "--stream-interval-s", "0.05", "--keepalive-s", "0.3")
    proc = worker_process(broker.url, names.run, tiny_model_dir, "w3", *args)
    proc.wait_ready()
    try:
        n = 600  # about 1.5 s of the tiny model: the keepalive comes several times
        whole = await Call(nc, names, "c1", streamed=False, max_tokens=n, temperature=0).start()
        started = time.monotonic()
        await whole.finished()
        elapsed = time.monotonic() - started
        streamed = await Call(nc, names, "c2", max_tokens=n, temperature=0).start()
        await streamed.finished()
    finally:
        proc.stop()
    assert whole.tokens == streamed.tokens == greedy(tiny_model_dir, PROMPT, n)
    assert [c.seq for c in whole.chunks] == list(range(len(whole.chunks)))
    assert whole.chunks[0].token_ids == [] and all(c.token_ids for c in whole.chunks[1:])
    # seq 0, one at the end, and between them one per keepalive period at most (the keepalive
    # sends what is held once 0.3 s passed without a chunk)
    assert 3 <= len(whole.chunks) <= 2 + elapsed / 0.3
    assert len(streamed.chunks) > 2 * len(whole.chunks)


async def test_weight_update_mid_request_relabels_the_rest(
    broker, worker, nc, js, names, tiny_model_dir
):
    blob = perturbed_weights(tiny_model_dir, seed=1)
    n_tokens = 1500  # long enough to outlast publishing and loading a version on a busy machine
    call = await Call(nc, names, "c1", max_tokens=n_tokens, temperature=0).start()
    await eventually(lambda: len(call.tokens) >= 5)
    event = await publish_weights(js, names, 1, blob)
    assert event.sha256 == hashlib.sha256(blob).hexdigest()
    last = await call.finished()
    assert last.finish_reason is FinishReason.LENGTH and len(call.tokens) == n_tokens
    # Chunks carry several tokens, yet none crosses the switch (a chunk has one version; the
    # continuation below is checked against the new weights from the first relabelled token).
    assert max(len(c.token_ids) for c in call.chunks) > 1
    versions = [c.version for c in call.chunks for _ in c.token_ids]
    switch = versions.index(1)
    assert 5 <= switch < n_tokens and versions == [0] * switch + [1] * (n_tokens - switch)
    # The tokens after the switch are the new weights' greedy continuation.
    prefix = PROMPT + call.tokens[:switch]
    assert call.tokens[switch : switch + 20] == greedy(tiny_model_dir, prefix, 20, blob)
    await eventually(lambda: _registered_version(js, names, "w1", 1), timeout=30)
    assert await metric(worker.metrics_url, "sf_rollout_weight_version") == 1
    assert await metric(worker.metrics_url, "sf_rollout_interruptions_total") == 1

    # A worker that starts later (alone now) serves the latest version from its first request.
    worker.stop()
    late = worker_process(broker.url, names.run, tiny_model_dir, "w2").wait_ready()
    try:
        assert (await registered(js, names, "w2")).version == 1
        first = await Call(nc, names, "c-late", max_tokens=4, temperature=0).start()
        assert (await first.finished(timeout=30)).finish_reason is FinishReason.LENGTH
        assert {c.version for c in first.chunks} == {1}
    finally:
        late.stop()


async def test_a_host_local_copy_is_loaded_in_place_and_others_wait_for_the_store(
    broker, worker, nc, js, names, tiny_model_dir, tmp_path
):
    # v1: a copy on this host, never stored: the worker can only have loaded it in place.
    first = perturbed_weights(tiny_model_dir, seed=1)
    folder = local_folder(tmp_path, names, 1)
    folder.mkdir(parents=True)
    (folder / LOCAL_BLOB).write_bytes(first)
    event = await announce_local(js, names, 1, folder)
    assert event.host == host_id() and event.sha256 is None and event.size_bytes == len(first)
    await eventually(lambda: _registered_version(js, names, "w1", 1), timeout=30)
    call = await Call(nc, names, "c1", max_tokens=8, temperature=0).start()
    await call.finished()
    assert call.tokens == greedy(tiny_model_dir, PROMPT, 8, first)

    # v2 as another host's copy, then as a copy of this host that is gone: neither is loaded
    # (nor counted as an error); the store's announcement of v2 is.
    second = perturbed_weights(tiny_model_dir, seed=2)
    gone = local_folder(tmp_path, names, 2) / LOCAL_BLOB
    for host in ("elsewhere/0", host_id()):
        foreign = WeightsPublished(
            version=2,
            location=gone.as_uri(),
            sha256=None,
            size_bytes=len(second),
            published_at=time.time(),
            host=host,
        )
        await js.publish(names.weights, codec.encode(foreign))
    await asyncio.sleep(1)
    assert (await registered(js, names, "w1")).version == 1
    await publish_weights(js, names, 2, second)
    await eventually(lambda: _registered_version(js, names, "w1", 2), timeout=30)
    assert await metric(worker.metrics_url, "sf_rollout_weight_errors_total") == 0
    call = await Call(nc, names, "c2", max_tokens=8, temperature=0).start()
    await call.finished()
    assert call.tokens == greedy(tiny_model_dir, PROMPT, 8, second)


async def test_a_version_handed_over_in_process_is_loaded_once_with_its_numbers(
    nc, js, names, tiny_model_dir, tmp_path
):
    """A colocated trainer hands each version to its worker's hf engine in its step
    (``take_weights``, beside the file's write): the engine serves it with the numbers the file
    gives, and the version's announcement then loads nothing. An older version, bad tensors
    (counted; the engine keeps its version) and a lent worker (its engine asleep) take nothing.
    In process, with a real hf engine."""
    engine = await start_engine(EngineConfig(tiny_model_dir, 2048, settings=HFEngineConfig()))
    worker = RolloutWorker(
        nc,
        names,
        engine,
        WorkerConfig(worker_id="w-in"),
        SMALL_RUN.gen,
        nats_url="",
        sleeps_idle=True,
    )
    blob = perturbed_weights(tiny_model_dir, seed=1)
    tensors = safetensors.torch.load(blob)
    loads0 = {path: _loads(path) for path in ("in_process", "local", "store")}
    errors0 = _rollout_count("sf_rollout_weight_errors_total")
    try:
        await worker.take_weights(1, tensors)
        assert engine.version == 1 and _loads("in_process") == loads0["in_process"] + 1
        # The same version announced as this host's file: already loaded, nothing read.
        folder = local_folder(tmp_path, names, 1)
        folder.mkdir(parents=True)
        (folder / LOCAL_BLOB).write_bytes(blob)
        await worker._weights._load(await announce_local(js, names, 1, folder))
        older = {name: t + 1 for name, t in tensors.items()}
        await worker.take_weights(1, older)  # not newer: ignored
        wrong = {**tensors, "model.embed_tokens.weight": torch.zeros(3, 3)}
        await worker.take_weights(2, wrong)  # refused, counted, v1 kept
        assert engine.version == 1
        assert _rollout_count("sf_rollout_weight_errors_total") == errors0 + 1
        assert {path: _loads(path) for path in loads0} == {
            **loads0,
            "in_process": loads0["in_process"] + 1,
        }
        await worker.take(Role.ROLLOUT)
        call = await Call(nc, names, "c-in", max_tokens=6, temperature=0).start()
        await call.finished()
        assert {c.version for c in call.chunks} == {1}
        assert call.tokens == greedy(tiny_model_dir, PROMPT, 6, blob)
        await worker.take(Role.IDLE)  # lent: the engine sleeps
        await worker.take_weights(3, tensors)
        assert engine.version == 1 and _loads("in_process") == loads0["in_process"] + 1
    finally:
        await worker._stop_serving("test over", cause="stopping")
        await engine.close()


async def test_a_lone_colocated_engine_holds_each_version_until_another_worker_needs_a_file(
    nc, js, names, tiny_model_dir, tmp_path
):
    """``trainer.publisher`` with the rollout worker of its own process (``InProcess``): while
    no other worker that may load a version is in the registry, a version the engine took in
    process is announced as held there and no file is written; once one registers, the held
    version's file is written and announced (the same tensors), and the next version gets its
    file in the step and is not handed over; at close the last is stored for every host. Real
    broker, registry and hf engine."""
    from prometheus_client import CollectorRegistry, Histogram

    from broker.registry import Registration
    from broker.weights import latest_weights, local_copy
    from trainer.config import TrainerConfig
    from trainer.publisher import Held, InProcess, Model, WeightPublisher
    from trainer.watch import ServingWatch

    engine = await start_engine(EngineConfig(tiny_model_dir, 2048, settings=HFEngineConfig()))
    worker = RolloutWorker(
        nc, names, engine, WorkerConfig(worker_id="w-own"), SMALL_RUN.gen, nats_url=""
    )
    watch = ServingWatch(30.0)
    following = asyncio.create_task(watch.follow(js, names))
    model = Model(asyncio.Lock(), lambda: version)
    seconds = Histogram("t_held_seconds", "test", ["path"], registry=CollectorRegistry())
    config = TrainerConfig(local_weights_dir=tmp_path)
    held = Held(InProcess("w-own", worker.take_weights), model)
    publisher = WeightPublisher(js, names, config, seconds, watch, held)
    uploading = asyncio.create_task(publisher.run())
    first = safetensors.torch.load(perturbed_weights(tiny_model_dir, seed=1))
    second = safetensors.torch.load(perturbed_weights(tiny_model_dir, seed=2))
    try:
        version = 1
        assert await publisher.publish(1, lambda: first)
        held = await latest_weights(js, names)
        assert (held.version, held.location, held.host) == (1, "process://w-own", host_id())
        assert engine.version == 1 and local_copy(held) is None
        assert not list(tmp_path.rglob("*.safetensors"))  # nothing written
        await asyncio.sleep(1.5)  # run looked again: still nobody else
        assert not list(tmp_path.rglob("*.safetensors"))

        other = await Registration.open(js, names, "w-other", tags=["rollout"], role=Role.IDLE)
        await other.put()
        async with asyncio.timeout(10):
            while (latest := await latest_weights(js, names)).location == held.location:
                await asyncio.sleep(0.05)
        assert latest.version == 1 and latest.host == host_id()
        folder = local_copy(latest)
        assert folder is not None
        written = safetensors.torch.load_file(folder / LOCAL_BLOB)
        assert all(torch.equal(written[name], t) for name, t in first.items())

        version = 2  # the other worker still needs files: written in the step, not handed over
        assert await publisher.publish(2, lambda: second)
        latest = await latest_weights(js, names)
        assert latest.version == 2 and local_copy(latest) is not None and engine.version == 1
    finally:
        publisher.close()
        await asyncio.wait_for(uploading, 60)
        following.cancel()
        await engine.close()
    stored = await latest_weights(js, names)
    assert (stored.version, stored.host) == (2, None)  # stored for every host at close


def _loads(path: str) -> float:
    return _rollout_count("sf_rollout_weight_load_seconds_count", path=path)


def _rollout_count(name: str, **labels: str) -> float:
    return ROLLOUT_METRICS.get_sample_value(name, labels) or 0.0


async def test_bad_weights_are_refused_and_counted(broker, worker, nc, js, names, tiny_model_dir):
    event = WeightsPublished(
        version=3,
        location=f"objstore://{names.weights_store}/missing.safetensors",
        sha256="0" * 64,
        size_bytes=10,
        published_at=time.time(),
    )
    await js.publish(names.weights, codec.encode(event))

    async def refused() -> bool:
        return await metric(worker.metrics_url, "sf_rollout_weight_errors_total") == 1

    await eventually(refused)
    call = await Call(nc, names, "c1", max_tokens=4, temperature=0).start()
    assert (await call.finished()).version == 0
    # A worker starting while the newest version is unusable starts anyway, and says so.
    late = worker_process(broker.url, names.run, tiny_model_dir, "w2")
    await asyncio.to_thread(late.wait_ready)
    try:
        assert await metric(late.metrics_url, "sf_rollout_weight_errors_total") == 1
        assert (await registered(js, names, "w2")).version == 0
    finally:
        late.stop()


async def test_cancel_then_stop_end_attempts_with_abort(worker, nc, js, names):
    call = await Call(nc, names, "c1", max_tokens=100000, temperature=1.0).start()
    await eventually(lambda: len(call.tokens) >= 3)
    cancel = GenerationCancelled(call_id="c1", attempt=0, reason="client went away")
    await nc.publish(names.gen_cancel("c1"), codec.encode(cancel))
    last = await call.finished()
    assert last.finish_reason is FinishReason.ABORT and "client went away" in last.error
    await eventually(lambda: _stream_empty(js, names.gen_stream))
    # Tokens held for the next chunk went out with the abort: every token generated arrived.
    assert await metric(worker.metrics_url, "sf_rollout_tokens_total") == len(call.tokens)

    running = await Call(nc, names, "c2", max_tokens=100000, temperature=1.0).start()
    await eventually(lambda: len(running.tokens) >= 3)
    assert worker.stop() == 0
    last = await running.finished(timeout=5)
    assert last.finish_reason is FinishReason.ABORT
    assert last.error == "interrupted: worker stopping"
    assert await registered(js, names, "w1") is None  # deregistered
    await eventually(lambda: _stream_empty(js, names.gen_stream))


async def _stream_empty(js, stream: str) -> bool:
    return (await js.stream_info(stream)).state.messages == 0


async def _stream_has(js, stream: str, n: int) -> bool:
    return (await js.stream_info(stream)).state.messages == n


async def _registered_version(js, names, worker_id: str, version: int) -> bool:
    entry = await registered(js, names, worker_id)
    return entry is not None and entry.version == version


async def test_a_stopping_worker_hands_requests_back_unfailed(nc, js, names):
    """A request fetched while the worker stops goes back to the queue at once, for another
    worker: counted returned, never failed, retried after a delay nor dead-lettered. The worker
    runs in this process, put in its stopping state as ``run`` does on stop; its engine is never
    reached, so it has none."""
    worker = RolloutWorker(
        nc, names, None, WorkerConfig(worker_id="w-stopping"), SMALL_RUN.gen, nats_url=""
    )
    worker._stopping = True
    ingress = worker.requests_ingress()  # the worker's own, as run() consumes with it
    returned0, failed0 = _ingress_count("returned"), _ingress_count("failed")
    await Call(nc, names, "c-stop", max_tokens=4).start()
    stop = asyncio.Event()
    run = asyncio.create_task(ingress.run(stop))
    try:
        await eventually(lambda: _ingress_count("returned") > returned0, watch=run)
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)
    assert _ingress_count("failed") == failed0
    assert await stream_messages(js, names.dead_stream, MessageRejected) == []
    assert await _stream_has(js, names.gen_stream, 1)  # still queued


@pytest.mark.parametrize("sleeps_idle", [False, True], ids=["warm", "lending-memory"])
async def test_a_lend_does_not_wait_for_the_pending_fetch_and_a_reclaim_serves_what_came(
    nc, js, names, tiny_model_dir, tmp_path, monkeypatch, sleeps_idle
):
    """Lent (``take(idle)``), the worker stops routing, aborts and pauses its engine without
    waiting for its ingress's pending fetch (up to ``FETCH_TIMEOUT_S``; 30 s here, so that the
    fetch is surely still pending): that ingress hands back what the fetch brings and ends by
    itself, and the reclaim serves the request. In process, with a real hf engine. A worker
    lending the device's memory (a colocated one's ``sleeps_idle``) also puts its engine to
    sleep, fetches no version meanwhile, and its reclaim wakes the engine and loads the version
    published meanwhile before serving."""
    monkeypatch.setattr(rollout.worker, "FETCH_TIMEOUT_S", 30.0)
    engine = await start_engine(EngineConfig(tiny_model_dir, 2048, settings=HFEngineConfig()))
    config = WorkerConfig(worker_id="w-lent")
    worker = RolloutWorker(
        nc, names, engine, config, SMALL_RUN.gen, nats_url="", sleeps_idle=sleeps_idle
    )
    handovers0 = [_handovers(step) for step in ("engine_sleep", "engine_wake")]
    try:
        await worker.take(Role.ROLLOUT)
        ingress = worker._serving
        assert ingress is not None
        await eventually(lambda: _pulls_waiting(js, names), watch=ingress)  # fetching, idle
        await asyncio.wait_for(worker.take(Role.IDLE), 10)  # waiting for the fetch: 30 s
        weights = None
        if sleeps_idle:  # asleep: only a wake lets it resume; a version waits for the reclaim
            with pytest.raises(EngineError, match="asleep"):
                await engine.resume()
            weights = perturbed_weights(tiny_model_dir, seed=1)
            # A version in the object store is not even fetched while lent (this worker has no
            # URL to fetch it from: a fetch would fail or wait forever).
            stored = await publish_weights(js, names, 1, weights)
            await asyncio.wait_for(worker._weights._load(stored), 10)
            folder = local_folder(tmp_path, names, 1)
            folder.mkdir(parents=True)
            (folder / LOCAL_BLOB).write_bytes(weights)
            await announce_local(js, names, 1, folder)
        assert not ingress.done()  # its fetch is still pending
        returned0 = _ingress_count("returned")
        call = await Call(nc, names, "c-lent", max_tokens=4, temperature=0).start()
        await asyncio.wait_for(ingress, 10)  # the fetch brought the request: handed back, ended
        assert _ingress_count("returned") == returned0 + 1 and call.chunks == []
        monkeypatch.undo()  # the reclaim's ingress fetches as usual
        await worker.take(Role.ROLLOUT)
        last = await call.finished()
        assert last.finish_reason is FinishReason.LENGTH
        assert engine.version == (1 if sleeps_idle else 0)
        assert call.tokens == greedy(tiny_model_dir, PROMPT, 4, weights)
        handovers = [_handovers(step) for step in ("engine_sleep", "engine_wake")]
        assert handovers == [n + sleeps_idle for n in handovers0]  # each timed on /metrics
    finally:
        await worker._stop_serving("test over", cause="stopping")
        await engine.close()


async def _pulls_waiting(js, names: RunNames) -> bool:
    info = await js.consumer_info(names.gen_stream, Durable.ROLLOUT)
    return (info.num_waiting or 0) > 0


def _handovers(step: str) -> float:
    labels = {"step": step}
    return (
        ROLLOUT_METRICS.get_sample_value("sf_rollout_memory_handover_seconds_count", labels) or 0.0
    )


def _ingress_count(outcome: str) -> float:
    labels = {"source": "gen", "outcome": outcome}
    return INGRESS_METRICS.get_sample_value("sf_ingress_messages_total", labels) or 0.0


async def test_weight_waves_load_one_wave_after_the_other(broker, nc, js, names, tiny_model_dir):
    """Two workers, two waves: for every version the second (by id) loads only once the first
    serves it, so one of them is always generating; each step of that rhythm shows in their
    registry entries as it happens."""
    args = ("--weight-waves", "2", "--heartbeat-s", "0.5")
    workers = [
        worker_process(broker.url, names.run, tiny_model_dir, wid, *args) for wid in ("wa", "wb")
    ]
    seen: dict[str, list[tuple[float, int]]] = {"wa": [], "wb": []}
    rhythm: dict[str, set[tuple[WeightsState, int | None]]] = {"wa": set(), "wb": set()}

    async def follow() -> None:
        async for wid, entry in watch_workers(js, names):
            if entry is None or wid not in seen or entry.version is None:
                continue
            rhythm[wid].add((entry.weights, entry.wave))
            if not seen[wid] or seen[wid][-1][1] != entry.version:
                seen[wid].append((time.monotonic(), entry.version))

    try:
        await asyncio.gather(*(asyncio.to_thread(w.wait_ready) for w in workers))
        following = asyncio.create_task(follow())
        for version in (1, 2, 3):
            await publish_weights(js, names, version, perturbed_weights(tiny_model_dir, version))
            for wid in ("wa", "wb"):
                await eventually(lambda w=wid, v=version: _registered_version(js, names, w, v))
        following.cancel()
        waited = await metric(workers[1].metrics_url, "sf_rollout_weight_wave_wait_seconds_count")
        assert await metric(workers[1].metrics_url, "sf_rollout_weight_wave") == 1
    finally:
        for w in workers:
            w.stop()
    # Each step of the rhythm is written as it happens (heartbeats alone would miss most): the
    # second wave is seen waiting for the first, each loading, each ready again, in its wave.
    for wid, wave in (("wa", 0), ("wb", 1)):
        states = {WeightsState.WAITING, WeightsState.LOADING, WeightsState.READY}
        assert {(state, wave) for state in states} <= rhythm[wid], (wid, rhythm[wid])
    first = {v: t for t, v in seen["wa"]}
    for at, version in seen["wb"]:
        if version >= 1:
            assert at >= first[version], (version, seen)
    assert waited == 3


async def test_an_engine_stuck_loading_is_quarantined_and_rejoins(
    broker, nc, js, names, tiny_model_dir
):
    """A load deadline shorter than any real load: every load overruns it. The worker stops
    serving and aborts what it has in flight (continued elsewhere), then rejoins on the new
    version and serves again."""
    args = ("--weight-load-timeout-s", "1e-6", "--max-model-len", "2048")
    w = worker_process(broker.url, names.run, tiny_model_dir, "wq", *args).wait_ready()
    try:
        call = await Call(nc, names, "cq", max_tokens=1500, temperature=0).start()
        await eventually(lambda: len(call.tokens) >= 5)
        await publish_weights(js, names, 1, perturbed_weights(tiny_model_dir, seed=4))
        last = await call.finished()
        assert last.finish_reason is FinishReason.ABORT and "quarantined" in last.error
        await eventually(lambda: _registered_version(js, names, "wq", 1), timeout=30)
        assert await metric(w.metrics_url, "sf_rollout_quarantines_total") == 1
        assert not (await registered(js, names, "wq")).quarantined
        again = await Call(nc, names, "cq2", max_tokens=8, temperature=0).start()
        done = await again.finished()
        assert done.finish_reason is FinishReason.LENGTH and {c.version for c in again.chunks} == {
            1
        }
    finally:
        w.stop()


async def test_workers_pull_generations_in_proportion_to_their_capacity(
    broker, nc, js, names, tiny_model_dir
):
    """Routing by capacity needs no weights: with a backlog, each worker pulls from the work
    queue only as many requests as it has free slots, so a worker registered with capacity 3
    runs three for the other's one, and the rest wait on the queue for the next free slot."""
    capacity = {"w-small": 1, "w-large": 3}
    workers = {
        wid: worker_process(
            broker.url,
            names.run,
            tiny_model_dir,
            wid,
            "--max-running",
            str(n),
            "--max-model-len",
            "2048",
        )
        for wid, n in capacity.items()
    }
    try:
        await asyncio.gather(*(asyncio.to_thread(w.wait_ready) for w in workers.values()))
        for wid, n in capacity.items():
            assert (await registered(js, names, wid)).capacity == n
        calls = [
            await Call(nc, names, f"c{i}", max_tokens=100000, temperature=1.0).start()
            for i in range(8)
        ]

        async def running() -> dict[str, float]:
            return {
                wid: await metric(w.metrics_url, "sf_rollout_requests_running")
                for wid, w in workers.items()
            }

        async def full() -> bool:
            return await running() == capacity

        await eventually(full)
        info = await js.consumer_info(names.gen_stream, Durable.ROLLOUT)
        assert (info.num_ack_pending, info.num_pending) == (4, 4)
        for _ in range(5):  # and it stays so: nobody pulls past its capacity
            await asyncio.sleep(0.2)
            # At most, not exactly: a call that samples EOS ends, and its worker's next pull
            # refills the slot a moment later.
            now = await running()
            assert all(now[wid] <= n for wid, n in capacity.items()), now
            info = await js.consumer_info(names.gen_stream, Durable.ROLLOUT)
            assert info.num_ack_pending <= sum(capacity.values()), info
        served = {c.chunks[0].worker_id for c in calls if c.chunks}
        assert served == set(capacity)
    finally:
        for w in workers.values():
            w.stop()


ONE_AT_A_TIME = """
[worker]
max_running = 8
max_waiting = 1
[worker.engine]
kind = "emulated"
chunk_s = 0.05
[worker.engine.workload.engine]
a_s = 0.01
b_s = 0.0
prefill_s_per_token = 0.0
max_batch = 1
[worker.engine.workload.lengths]
median = 100000
sigma = 0.0
cap = 100000
"""
"""Workers whose engine (the emulated one: 10 ms a token, every request as long as its
max_tokens) generates one request at a time."""


def worker_args(tmp_path: Path, config: str) -> tuple[str, ...]:
    """A worker's flags for the run config ``config``, written under ``tmp_path``."""
    path = tmp_path / "worker.toml"
    path.write_text(config)
    return ("--config", str(path), "--max-model-len", "4096")


async def two_stay_on_the_queue(js, names: RunNames, worker) -> None:
    """Two requests come to wait on the queue while ``worker`` holds one its engine has not
    started, and they stay there."""

    async def two_left_on_the_queue() -> bool:
        info = await js.consumer_info(names.gen_stream, Durable.ROLLOUT)
        waiting = await metric(worker.metrics_url, "sf_rollout_requests_waiting")
        return (info.num_pending, info.num_ack_pending, waiting) == (2, 2, 1)

    await eventually(two_left_on_the_queue)
    await asyncio.sleep(1.0)  # and they stay there
    assert await two_left_on_the_queue()


async def test_a_worker_whose_engine_is_full_leaves_the_backlog_to_other_workers(
    broker, nc, js, names, tiny_model_dir, tmp_path
):
    """A worker takes requests only while fewer than ``max_waiting`` of its own have not started
    in its engine. Busy with a long request on an engine that runs one at a time, a worker with
    8 free ``max_running`` slots takes one of three more and leaves two on the queue, where a
    worker started later takes them and ends them while the long one still runs. Before, the
    first worker took all three (its free slots) to wait in its engine behind the long one."""
    args = worker_args(tmp_path, ONE_AT_A_TIME)
    first = worker_process(broker.url, names.run, tiny_model_dir, "w-first", *args)
    later = None
    try:
        await asyncio.to_thread(first.wait_ready)
        long = await Call(nc, names, "long", max_tokens=3000).start()  # 30 s
        await eventually(lambda: bool(long.tokens))
        short = [await Call(nc, names, f"short{i}", max_tokens=5).start() for i in range(3)]

        await two_stay_on_the_queue(js, names, first)
        later = worker_process(broker.url, names.run, tiny_model_dir, "w-later", *args)
        await asyncio.to_thread(later.wait_ready)
        await eventually(lambda: sum(c.done.is_set() for c in short) == 2)
        assert sorted(c.chunks[-1].worker_id for c in short if c.done.is_set()) == ["w-later"] * 2
        assert not long.done.is_set() and {c.worker_id for c in long.chunks} == {"w-first"}
    finally:
        first.stop()
        if later is not None:
            later.stop()


async def test_a_worker_whose_engine_turned_full_holds_one_request_not_started(
    broker, nc, js, names, tiny_model_dir, tmp_path
):
    """``max_waiting`` (the default, 4) holds while the engine starts what it is given; once a
    request has waited several of the engine's steps to start, the worker holds one. Busy with
    a long request on an engine that runs one at a time, a worker takes a short one; once that
    one has waited, two more stay on the queue, and a worker started later ends them while the
    long one still runs. Before, the worker took both (up to 4) to wait behind the long one."""
    args = worker_args(tmp_path, ONE_AT_A_TIME.replace("max_waiting = 1\n", ""))
    first = worker_process(broker.url, names.run, tiny_model_dir, "w-first", *args)
    later = None
    try:
        await asyncio.to_thread(first.wait_ready)
        long = await Call(nc, names, "long", max_tokens=3000).start()  # 30 s
        await eventually(lambda: len(long.chunks) >= 4)  # its tokens measure the engine's step
        held = await Call(nc, names, "short0", max_tokens=5).start()
        await eventually(lambda: bool(held.chunks))  # taken (its "started" chunk)
        await asyncio.sleep(0.5)  # 50 of the engine's steps: it waits behind the long one
        short = [await Call(nc, names, f"short{i}", max_tokens=5).start() for i in (1, 2)]

        await two_stay_on_the_queue(js, names, first)
        assert await metric(first.metrics_url, "sf_rollout_intake_limited") == 1
        later = worker_process(broker.url, names.run, tiny_model_dir, "w-later", *args)
        await asyncio.to_thread(later.wait_ready)
        await eventually(lambda: all(c.done.is_set() for c in short))
        assert {c.chunks[-1].worker_id for c in short} == {"w-later"}
        assert not long.done.is_set() and not held.done.is_set()
    finally:
        first.stop()
        if later is not None:
            later.stop()
