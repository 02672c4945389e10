"""The trainer: data-parallel equivalence on CPU (2 gloo ranks), the service on a real broker
(batches, staleness, duplicates, dead letters, acks, weight publication, a real rollout worker
following it), and resume after ``kill -9`` of the ``seamlessflow trainer`` process."""

import asyncio
import hashlib
import itertools
import logging
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

from broker import codec
from broker.config import ConsumerLimits
from broker.messages import Admitted, MessageRejected, Role, SampleReady, WeightsPublished
from broker.provision import provision_run
from broker.registry import watch_workers
from broker.subjects import Durable, RunNames
from broker.weights import fetch_weights, host_id, latest_weights, run_instance
from broker.worker_messages import TrainerShape
from common.staleness import StalenessMode
from seamlessflow.processes import ServiceProcess, worker_process
from tests.support import (
    SMALL_RUN,
    consumer_settled,
    eventually,
    metric,
    registered,
    serving_trainer,
    stream_messages,
)
from tests.test_losses import sample
from tests.test_tagsched import ask
from trainer import checkpoint
from trainer.batcher import plan_step
from trainer.config import TrainerConfig


async def publish(js, names: RunNames, *samples: SampleReady, msg_id: bool = True) -> None:
    for s in samples:
        headers = codec.headers(msg_id=s.sample_id if msg_id else None)
        await js.publish(names.samples, codec.encode(s), headers=headers)


def group(gid: str, size: int, *, version: int = 0, base: int = 0) -> list[SampleReady]:
    """``size`` single-sample sessions with rewards 0, 1, 2, ... and distinct completions."""
    return [
        sample(
            f"{gid}-{i}",
            gid,
            versions=(version,) * 3,
            reward=float(i),
            group_size=size,
            completion=(40 + base + i, 41 + i, 42),
        )
        for i in range(size)
    ]


# -- data parallel ------------------------------------------------------------------------------
DP_CONFIG = TrainerConfig(lr=1.0, adam_eps=1.0, max_grad_norm=1e6, max_staleness=100)


def dp_items():
    samples = group("dp", 5)
    samples[1] = sample("dp-1", "dp", reward=3.0, group_size=5, prompt=(9, 8, 7, 6, 5))
    items, _, _ = plan_step([samples], 0, DP_CONFIG)
    return items


def _dp_rank(rank: int, init: str, model: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.backends import build_backend
    from trainer.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    backend = build_backend(Path(model), DP_CONFIG)
    train_step(backend, dp_items(), 0, DP_CONFIG)
    save_file(backend.hf_state_dict(), f"{out}/rank{rank}.safetensors")
    dist.destroy_process_group()


def test_two_rank_data_parallel_step_equals_one_rank(tiny_model_dir, tmp_path):
    from tests.support import free_port
    from trainer.backends import build_backend
    from trainer.step import train_step

    init = f"tcp://127.0.0.1:{free_port()}"
    torch.multiprocessing.spawn(
        _dp_rank, args=(init, str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True
    )
    single = build_backend(tiny_model_dir, DP_CONFIG)
    before = checkpoint.snapshot(single.hf_state_dict())  # a copy: the model's own tensors
    train_step(single, dp_items(), 0, DP_CONFIG)
    one = single.hf_state_dict()
    ranks = [load((tmp_path / f"rank{r}.safetensors").read_bytes()) for r in range(2)]
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    assert moved > 1e-3  # the step did something, so the comparison below means something
    for name, tensor in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], tensor, atol=1e-5, rtol=0), name


def test_a_trainer_of_two_local_ranks_steps_as_one_rank(tiny_model_dir):
    """``world_size = 2``: rank 0 starts the other rank as a local process, which joins through
    rank 0's store (on a port the OS picked as it bound it), and the two train their shards: the
    step is one rank's."""
    from trainer.backends import build_backend
    from trainer.ranks import RankGroup
    from trainer.step import train_step

    single = build_backend(tiny_model_dir, DP_CONFIG)
    before = checkpoint.snapshot(single.hf_state_dict())
    train_step(single, dp_items(), 0, DP_CONFIG)
    one = single.hf_state_dict()
    two = RankGroup(tiny_model_dir, DP_CONFIG.model_copy(update={"world_size": 2, "threads": 1}))
    try:
        assert two.distributed and two.local_world_size == 2
        two.step(dp_items(), 0)
        got = two.backend.hf_state_dict()
    finally:
        two.close()
    assert max(float((one[k] - before[k]).abs().max()) for k in one) > 1e-3
    for name, tensor in one.items():
        assert torch.allclose(got[name], tensor, atol=1e-5, rtol=0), name


# -- the service, in process --------------------------------------------------------------------
async def _stored(js, names: RunNames) -> bool:
    """The newest announcement is the object store's (not a host-local copy)."""
    latest = await latest_weights(js, names)
    return latest is not None and latest.host is None


async def _consumer_settled(js, names: RunNames) -> bool:
    return await consumer_settled(js, names.samples_stream, Durable.TRAINER)


@pytest.mark.newest_nats
async def test_service_trains_groups_and_settles_every_sample(
    broker, js, names, tiny_model_dir, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="trainer.service")

    config = TrainerConfig(
        lr=1e-3,
        groups_per_step=2,
        max_staleness=0,
        staleness_mode=StalenessMode.DROP,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=1,
        worker_id="trainer-t",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    serving = await serving_trainer(broker.url, js, names, config, tiny_model_dir, stop)
    entry = await registered(js, names, "trainer-t")
    url = entry.metrics_url
    # The entry carries what the scheduler admits by.
    assert entry.trainer == TrainerShape(groups_per_step=2, max_staleness=0, staleness_mode="drop")
    before = {o: await metric(url, "sf_trainer_samples_total", outcome=o) for o in
              ("trained", "stale_dropped", "duplicate")}  # fmt: skip
    dropped_before = await metric(url, "sf_trainer_samples_dropped_total", reason="stale")
    # the registry is this process's: an earlier test's trainer may have published already
    published = {
        p: await metric(url, "sf_trainer_weight_publish_seconds_count", path=p)
        for p in ("local", "store")
    }
    worker = None
    try:
        a, b = group("a", 2), group("b", 3)
        # A fourth session in a group of three (refused), and garbage.
        extra = sample("b-x", "b", "b-extra", group_size=3)
        await publish(js, names, a[0], b[0], b[1], b[2], extra, a[1])
        await js.publish(names.samples, b"\x93not a sample")
        await eventually(lambda: _consumer_settled(js, names), watch=serving, timeout=60)
        await eventually(lambda: metric(url, "sf_trainer_version"), watch=serving)  # published
        # The host-local copy is announced; no rollout worker needs the store: not stored.
        await asyncio.sleep(1.5)  # the upload task looks again every second
        events = await stream_messages(js, names.weights_stream, WeightsPublished)
        assert [(e.version, e.host) for e in events] == [(1, host_id())]
        for path, more in (("local", 1), ("store", 0)):
            count = await metric(url, "sf_trainer_weight_publish_seconds_count", path=path)
            assert count - published[path] == more, path
        local = config.local_weights_dir / await run_instance(js, names) / names.run
        assert (local / "v1" / "model.safetensors").exists()
        dead = await stream_messages(js, names.dead_stream, MessageRejected)
        assert len(dead) == 2 and any("sample b-x" in d.reason for d in dead)
        steps = checkpoint.read_steps(config.checkpoint_dir)
        assert [(s.version, sorted(s.sample_ids)) for s in steps] == [
            (1, sorted(s.sample_id for s in a + b))
        ]
        # Acked only once the step's checkpoint (written in the background) was durable.
        assert checkpoint.load_file(checkpoint.latest_path(config.checkpoint_dir)).version == 1
        # A rollout worker on this node loads v1 in place; the trainer sees it serve it.
        worker = worker_process(broker.url, names.run, tiny_model_dir, "w1").wait_ready()
        await eventually(
            lambda: metric(url, "sf_trainer_weights_serving_seconds_count"), timeout=60
        )
        # Stale (version 0 < trainer version 1, bound 0): dropped and acked, no step.
        c, d = group("c", 2), group("d", 1)
        await publish(js, names, *c, *d)
        # Already trained, redelivered as a new message: acked as a duplicate.
        await publish(js, names, a[0], msg_id=False)
        await eventually(lambda: _consumer_settled(js, names), watch=serving, timeout=30)
        after = {o: await metric(url, "sf_trainer_samples_total", outcome=o) for o in before}
        assert {o: after[o] - before[o] for o in before} == {
            "trained": 5, "stale_dropped": 3, "duplicate": 1
        }  # fmt: skip
        dropped = await metric(url, "sf_trainer_samples_dropped_total", reason="stale")
        assert dropped - dropped_before == 3
        # The steps log says which samples were dropped, and why; the skipped step made no
        # version; each group's drop is one WARNING line.
        skipped = checkpoint.read_steps(config.checkpoint_dir)[-1]
        assert (skipped.version, skipped.trained) == (1, ())
        assert dict(skipped.dropped) == {s.sample_id: "stale" for s in c + d}
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        for gid, n in (("c", 2), ("d", 1)):
            assert any(f"samples_dropped group={gid} reason=stale samples={n}" in x for x in lines)
        assert (await registered(js, names, "trainer-t")).version == 1
        assert await metric(url, "sf_trainer_version") == 1
    finally:
        if worker is not None:
            worker.stop()
        stop.set()
        await serving
    assert await registered(js, names, "trainer-t") is None
    assert not local.parent.exists()  # stopped: its copies are freed
    # Stopping stored the last version for every host (whoever starts next).
    assert await _stored(js, names)
    events = await stream_messages(js, names.weights_stream, WeightsPublished)
    assert [(e.version, e.host) for e in events] == [(1, None)]
    blob = await fetch_weights(js, events[0])
    original = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (
        load(blob)["model.embed_tokens.weight"].shape
        == load(original)["model.embed_tokens.weight"].shape
    )
    assert "lm_head.weight" not in load(blob)  # tied: the engines tie it themselves
    assert not torch.equal(
        load(blob)["model.embed_tokens.weight"], load(original)["model.embed_tokens.weight"]
    )


# -- kill -9 and resume -------------------------------------------------------------------------
def _trainer_process(url: str, run: str, model: Path, config: Path) -> ServiceProcess:
    args = ["trainer", "--nats", url, "--run", run, "--model", str(model), "--config", str(config)]
    return ServiceProcess("trainer", *args)


async def _killable_run(
    nc, js, run_name: str, tmp_path: Path, worker_id: str, extra: str = "checkpoint_every = 1\n"
) -> tuple[RunNames, Path, Path, list[WeightsPublished]]:
    """A run whose killed trainer's samples come back soon (ack_wait 3 s); its trainer's
    checkpoint folder and config file (``extra`` lines added to ``[trainer]``: by default a
    checkpoint every version, so a kill loses nothing); and every
    weights announcement as it is made (the stream keeps only the last)."""
    quick = ConsumerLimits(ack_wait_s=3, max_deliver=10, max_ack_pending=8192)
    await provision_run(js, run_name, SMALL_RUN.model_copy(update={"trainer": quick}))
    names = RunNames(run_name)
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.toml"
    config.write_text(
        f'[trainer]\ncheckpoint_dir = "{ckpt}"\nweights_dir = "{tmp_path / "weights"}"\n'
        f'groups_per_step = 1\nlr = 1e-3\nmax_staleness = 1000\nworker_id = "{worker_id}"\n' + extra
    )
    published: list[WeightsPublished] = []

    async def on_weights(msg) -> None:
        published.append(codec.decode(WeightsPublished, msg.data))

    await nc.subscribe(names.weights, cb=on_weights)
    return names, ckpt, config, published


@pytest.mark.newest_nats
async def test_trainer_resumes_after_kill_without_training_a_sample_twice(
    broker, nc, js, run_name, tiny_model_dir, tmp_path
):
    names, ckpt, config, published = await _killable_run(nc, js, run_name, tmp_path, "trainer-k")
    first = [group(f"g{i}", 2, base=i) for i in range(6)]
    second = [group(f"h{i}", 2, base=i) for i in range(4)]
    everything = {s.sample_id for g in first + second for s in g}
    proc = await asyncio.to_thread(
        _trainer_process(broker.url, names.run, tiny_model_dir, config).wait_ready
    )
    assert proc.handshake["version"] == 0  # the handshake, not the output (read apart, later)
    await publish(js, names, *[s for g in first for s in g])
    await eventually(lambda: len(checkpoint.read_steps(ckpt)) >= 2, timeout=60)
    proc.stop(signal.SIGKILL)
    await publish(js, names, *[s for g in second for s in g])

    restarted = await asyncio.to_thread(
        _trainer_process(broker.url, names.run, tiny_model_dir, config).wait_ready
    )
    try:
        resumed_at = restarted.handshake["version"]
        assert resumed_at >= 2
        await eventually(
            lambda: sum(len(s.sample_ids) for s in checkpoint.read_steps(ckpt)) >= len(everything),
            timeout=120,
        )
        await eventually(lambda: _consumer_settled(js, names), timeout=30)
    finally:
        assert restarted.stop() == 0, "".join(restarted.output)
    steps = checkpoint.read_steps(ckpt)
    trained = [sid for s in steps for sid in s.sample_ids]
    assert sorted(trained) == sorted(everything)  # none twice, none lost
    versions = [s.version for s in steps]
    assert len(steps) == len(first) + len(second)
    # Consecutive, except where the kill cut a checkpoint's write after its version was
    # announced: that version is taken, and so is the next one's if it was announced while it
    # waited for that write (one write in flight). Their samples come back and are trained
    # under new versions.
    gaps = [b - a for a, b in itertools.pairwise([0, *versions])]
    assert all(g == 1 for g in gaps) or (
        sorted(gaps)[-2] == 1
        and sorted(gaps)[-1] <= 3
        and any("versions_lost" in line for line in restarted.output)
    ), gaps
    # Every trained version was announced as a host-local copy (a lost one was too, unless the
    # kill came between its copy and its announcement: the restart counts the copy as taken);
    # the store got the newest (older ones may be skipped as superseded), and a version stored
    # twice carries the same content.
    await eventually(lambda: published and published[-1].version == versions[-1])
    await eventually(lambda: published[-1].host is None)
    local = sorted({e.version for e in published if e.host == host_id()})
    assert set(versions) <= set(local) <= set(range(1, versions[-1] + 1)), (local, versions)
    by_version: dict[int, set[str]] = {}
    for e in published:
        if e.host is None:
            by_version.setdefault(e.version, set()).add(e.sha256)
    assert max(by_version) == versions[-1]
    assert all(len(shas) == 1 for shas in by_version.values())
    last = published[-1]
    assert hashlib.sha256(await fetch_weights(js, last)).hexdigest() == last.sha256
    assert time.time() >= last.published_at


# -- checkpoints every few versions -------------------------------------------------------------
@pytest.mark.newest_nats
async def test_checkpoints_every_few_versions_and_at_stop(
    broker, js, names, tiny_model_dir, tmp_path
):
    ckpt = tmp_path / "ckpt"
    config = TrainerConfig(
        lr=1e-3,
        groups_per_step=1,
        max_staleness=1000,
        checkpoint_dir=ckpt,
        checkpoint_every=2,
        worker_id="trainer-e",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    serving = await serving_trainer(broker.url, js, names, config, tiny_model_dir, stop)
    try:
        url = (await registered(js, names, "trainer-e")).metrics_url
        for n, g in enumerate((group("a", 2), group("b", 3), group("c", 2)), start=1):
            await publish(js, names, *g)
            await eventually(lambda n=n: _eq(metric(url, "sf_trainer_version"), n), watch=serving)
            # acknowledged at once: admission counts unsettled samples as work to come
            await eventually(lambda: _consumer_settled(js, names), watch=serving, timeout=30)
            # checkpointed (and logged) at v2 only
            latest = checkpoint.latest_path(ckpt)
            assert (checkpoint.load_file(latest).version if latest else None) == (
                2 if n >= 2 else None
            )
            assert [s.version for s in checkpoint.read_steps(ckpt)] == ([] if n < 2 else [1, 2])
    finally:
        stop.set()
        await serving
    # stopping commits the step since the last checkpoint
    assert checkpoint.load_file(checkpoint.latest_path(ckpt)).version == 3
    assert [s.version for s in checkpoint.read_steps(ckpt)] == [1, 2, 3]


@pytest.mark.newest_nats
async def test_a_stopping_trainer_hands_a_held_sample_back_once(
    broker, js, names, tiny_model_dir, tmp_path
):
    """A sample held (its group incomplete) when the trainer stops is handed back and not taken
    again (but by a pull already in flight). Before, the ingress fetched until the last
    version's upload ended, and each fetch of a handed-back sample handed it back at once,
    until JetStream gave it up at max_deliver, silently: the fault suite lost a group so."""
    config = TrainerConfig(
        groups_per_step=1,
        max_staleness=1000,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=1,
        worker_id="trainer-h",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    serving = await serving_trainer(broker.url, js, names, config, tiny_model_dir, stop)
    held = sample("h-0", "h", "h-0", group_size=2)  # half a group
    try:
        url = (await registered(js, names, "trainer-h")).metrics_url
        await publish(js, names, *group("a", 2))  # a version to upload at stop
        await eventually(lambda: _eq(metric(url, "sf_trainer_version"), 1), watch=serving)
        await publish(js, names, held)
        await eventually(lambda: _eq(metric(url, "sf_trainer_samples_held"), 1), watch=serving)
    finally:
        stop.set()
        await serving
    sub = await js.pull_subscribe_bind(Durable.TRAINER, names.samples_stream)
    # A delivery to the pull in flight when fetching stopped comes back after ack_wait (15 s).
    ack_wait = SMALL_RUN.trainer.ack_wait_s
    (msg,) = await sub.fetch(1, timeout=ack_wait + 10)
    assert codec.decode(SampleReady, msg.data).sample_id == held.sample_id
    # The trainer's, maybe one more to the pull in flight when fetching stopped, and this one.
    assert msg.metadata.num_delivered <= 3
    await msg.nak()


async def _eq(value, want) -> bool:
    return await value == want


@pytest.mark.newest_nats
async def test_a_crash_loses_the_steps_since_the_checkpoint_and_training_goes_on_as_new_versions(
    broker, nc, js, run_name, tiny_model_dir, tmp_path
):
    names, ckpt, config, published = await _killable_run(
        nc, js, run_name, tmp_path, "trainer-c", "checkpoint_every = 3\nlocal_weights = false\n"
    )  # every version stored: its content (sha256) is announced
    groups = [group(f"g{i}", 2, base=i) for i in range(5)]
    proc = await asyncio.to_thread(
        _trainer_process(broker.url, names.run, tiny_model_dir, config).wait_ready
    )
    await publish(js, names, *[s for g in groups[:2] for s in g])
    await eventually(lambda: len({e.version for e in published}) >= 2, timeout=60)
    await eventually(lambda: _consumer_settled(js, names), timeout=30)
    proc.stop(signal.SIGKILL)  # v1 and v2 published and their samples acknowledged; no checkpoint
    assert checkpoint.latest_path(ckpt) is None
    await publish(js, names, *[s for g in groups[2:] for s in g])
    restarted = await asyncio.to_thread(
        _trainer_process(broker.url, names.run, tiny_model_dir, config).wait_ready
    )
    try:
        await eventually(lambda: any("versions_lost" in line for line in restarted.output))
        assert restarted.handshake["version"] == 3  # after v1 and v2
        await eventually(lambda: max(e.version for e in published) >= 6, timeout=120)
        await eventually(lambda: _consumer_settled(js, names), timeout=30)
    finally:
        assert restarted.stop() == 0, "".join(restarted.output)
    steps = checkpoint.read_steps(ckpt)  # v6 checkpointed with v4 and v5; nothing after
    assert [s.version for s in steps] == [4, 5, 6]
    assert sorted(sid for s in steps for sid in s.sample_ids) == sorted(
        s.sample_id for g in groups[2:] for s in g
    )
    # v3 is the initial weights again, checkpointed and published as a new version; no version
    # number was ever published with two contents.
    shas: dict[int, set[str]] = {}
    for e in published:
        if e.host is None:
            shas.setdefault(e.version, set()).add(e.sha256)
    assert 3 in shas and all(len(v) == 1 for v in shas.values())


# -- overlap: a step computed ahead ------------------------------------------------------------
def stamped(gid: str, ticket: int, version: int, size: int = 2) -> list[SampleReady]:
    """A group of admission ``ticket`` (stamped at ``version``), its tokens of ``version``."""
    return [
        s.model_copy(update={"admitted": Admitted(ticket=ticket, version=version)})
        for s in group(gid, size, version=version, base=10 * ticket)
    ]


@pytest.mark.newest_nats
async def test_overlap_computes_a_step_ahead_and_keeps_room_for_an_earlier_task(
    broker, js, names, tiny_model_dir, tmp_path
):
    """``trainer.overlap``: a complete group is computed before its step's other groups come;
    a step at v1 keeps a place for ticket 3 (its tokens at v0 would be past the bound at v2)
    instead of filling it with the later ticket 5, waits for it only once nothing is left to
    compute, and trains it; a group dropped whole is settled at once. Every sample trained once,
    steps logged as trained."""
    config = TrainerConfig(
        lr=1e-3,
        groups_per_step=2,
        max_staleness=1,
        staleness_mode=StalenessMode.DROP,
        overlap=True,
        order_wait_s=60,
        checkpoint_dir=tmp_path / "ckpt",
        worker_id="trainer-o",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    serving = await serving_trainer(broker.url, js, names, config, tiny_model_dir, stop)
    try:
        url = (await registered(js, names, "trainer-o")).metrics_url
        outcomes = ("trained", "stale_dropped")
        before = [await metric(url, "sf_trainer_samples_total", outcome=o) for o in outcomes]
        waited = await metric(url, "sf_trainer_order_wait_seconds_total")

        def ahead(n):
            return lambda: _eq(metric(url, "sf_trainer_groups_ahead"), n)

        def version(n):
            return lambda: _eq(metric(url, "sf_trainer_version"), n)

        stale = group("s", 2, version=0)  # complete at v2 (lag 2): dropped whole, settled at once
        await publish(js, names, *stamped("t1", 1, 0))
        await eventually(ahead(1), watch=serving)  # computed, its step not complete
        assert await metric(url, "sf_trainer_version") == 0
        await publish(js, names, *stamped("t2", 2, 0))
        await eventually(version(1), watch=serving)
        # At v1 ticket 3 (not seen; ticket 2's version, 0) must be in the next step.
        await publish(js, names, *stamped("t4", 4, 1))
        await eventually(ahead(1), watch=serving)
        await publish(js, names, *stamped("t5", 5, 1))  # no room: ticket 3's place is kept
        await asyncio.sleep(1.0)  # (a step would take ~0.1 s)
        assert (
            await metric(url, "sf_trainer_groups_ahead"),
            await metric(url, "sf_trainer_version"),
        ) == (1, 1)

        # Waiting for ticket 3, it says so in its entry (the scheduler lends for it), and goes on
        # saying so as samples of other tasks come: t4 computed ahead still counts.
        async def one_more_held() -> None:  # t4, t5 and this one: 5 held
            await publish(js, names, stale[0])
            await eventually(lambda: _consumer_settled_but(js, names, 5), watch=serving)

        told = await _order_waiting_told(js, names, one_more_held())
        assert told and set(told) == {1}, told
        await publish(js, names, *stamped("t3", 3, 0))
        await eventually(version(2), watch=serving)
        waited = await metric(url, "sf_trainer_order_wait_seconds_total") - waited
        assert waited > 0  # for ticket 3 (the time depends on the machine)
        await eventually(ahead(1), watch=serving)  # t5 (v1, lag 1 at v2), for the next step
        await publish(js, names, *stale)  # complete now (stale[0] again: a duplicate, dropped)
        await eventually(lambda: _consumer_settled_but(js, names, 2), watch=serving, timeout=30)
        await publish(js, names, *stamped("t6", 6, 2))
        await eventually(version(3), watch=serving)
        await eventually(lambda: _consumer_settled(js, names), watch=serving, timeout=30)
        after = [await metric(url, "sf_trainer_samples_total", outcome=o) for o in outcomes]
        assert [a - b for a, b in zip(after, before, strict=True)] == [12, 2]
    finally:
        stop.set()
        await serving
    steps = [(s.version, sorted({i.split("-")[0] for i in s.sample_ids}), len(s.dropped))
             for s in checkpoint.read_steps(config.checkpoint_dir)]  # fmt: skip
    assert steps == [
        (1, ["t1", "t2"], 0), (2, ["t3", "t4"], 0), (2, ["s"], 2), (3, ["t5", "t6"], 0)
    ]  # fmt: skip


@pytest.mark.newest_nats
async def test_overlap_computes_the_groups_that_waited_in_one_pass(
    broker, nc, js, names, tiny_model_dir, tmp_path
):
    """``trainer.overlap``: groups that completed while the trainer could not compute (here: while
    it was lent) are computed in one forward and backward, not one each, and make the step."""
    config = TrainerConfig(
        lr=1e-3,
        groups_per_step=3,
        overlap=True,
        checkpoint_dir=tmp_path / "ckpt",
        worker_id="trainer-p",
        local_weights_dir=tmp_path / "shm",
    )
    stop = asyncio.Event()
    serving = await serving_trainer(broker.url, js, names, config, tiny_model_dir, stop)
    try:
        url = (await registered(js, names, "trainer-p")).metrics_url

        async def passes() -> list[float]:  # this process's registry: earlier tests' too
            name = "sf_trainer_ahead_pass_groups"
            return [await metric(url, f"{name}_count"), await metric(url, f"{name}_sum")]

        before = await passes()
        assert (await ask(nc, names, "trainer-p", Role.IDLE, 1)).ok
        await publish(js, names, *(s for t in (1, 2, 3) for s in stamped(f"t{t}", t, 0)))
        await eventually(lambda: _consumer_settled_but(js, names, 6), watch=serving)
        assert await metric(url, "sf_trainer_version") == 0  # held, not computed, while lent
        assert (await ask(nc, names, "trainer-p", Role.TRAIN, 2)).ok
        await eventually(lambda: _eq(metric(url, "sf_trainer_version"), 1), watch=serving)
        assert [a - b for a, b in zip(await passes(), before, strict=True)] == [1, 3]
        await eventually(lambda: _consumer_settled(js, names), watch=serving, timeout=30)
    finally:
        stop.set()
        await serving
    steps = [(s.version, sorted(i.split("-")[0] for i in s.sample_ids))
             for s in checkpoint.read_steps(config.checkpoint_dir)]  # fmt: skip
    assert steps == [(1, ["t1", "t1", "t2", "t2", "t3", "t3"])]


async def _order_waiting_told(js, names: RunNames, meanwhile) -> list[int]:
    """The ``order_waiting`` of trainer-o's registry entry: now, and each write while
    ``meanwhile`` is awaited and for a second after (the trainer's loop answering it)."""
    told: list[int] = []

    async def watch() -> None:
        async for worker_id, entry in watch_workers(js, names):
            if worker_id == "trainer-o" and entry is not None:
                told.append(entry.order_waiting)

    watching = asyncio.create_task(watch())
    try:
        await eventually(lambda: bool(told), watch=watching)
        await meanwhile
        await asyncio.sleep(1.0)
    finally:
        watching.cancel()
    return told


async def _consumer_settled_but(js, names: RunNames, pending: int) -> bool:
    """All the trainer's samples acked but ``pending`` (held for a step computed ahead)."""
    info = await js.consumer_info(names.samples_stream, Durable.TRAINER)
    return info.num_pending == 0 and info.num_ack_pending == pending
