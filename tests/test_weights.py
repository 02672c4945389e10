"""Weight versions on a real broker: blobs in the object store or a shared folder, checked."""

import pytest

from broker.exceptions import WeightsIntegrityError
from broker.retry import TRANSIENT, retry
from broker.weights import (
    fetch_weights,
    fetch_weights_apart,
    latest_weights,
    local_folder,
    newest_local,
    publish_weights,
    run_instance,
)
from tests.support import SMALL_RUN, frozen


async def test_publish_fetch_and_latest(js, names, tmp_path):
    assert await latest_weights(js, names) is None
    first = await publish_weights(js, names, 1, b"one" * 1000)
    assert first.location == f"objstore://{names.weights_store}/v1.safetensors"
    assert await fetch_weights(js, first) == b"one" * 1000

    second = await publish_weights(js, names, 2, b"two", directory=tmp_path / "shared")
    assert second.location == (tmp_path / "shared" / "v2.safetensors").as_uri()
    assert await fetch_weights(js, second) == b"two"
    assert await latest_weights(js, names) == second  # the stream keeps the last event only

    (tmp_path / "shared" / "v2.safetensors").write_bytes(b"tw0")  # changed after publication
    with pytest.raises(WeightsIntegrityError, match=r"got 3 bytes with sha256 .* the event says"):
        await fetch_weights(js, second)
    (tmp_path / "shared" / "v2.safetensors").unlink()
    with pytest.raises(WeightsIntegrityError, match=r"weights v2: cannot read file://"):
        await fetch_weights(js, second)
    gone = first.model_copy(update={"location": f"objstore://{names.weights_store}/v9.x"})
    with pytest.raises(WeightsIntegrityError, match=r"weights v1: cannot read objstore://"):
        await fetch_weights(js, gone)
    elsewhere = first.model_copy(update={"location": "s3://bucket/v1"})
    with pytest.raises(WeightsIntegrityError, match=r"unsupported location 's3://bucket/v1'"):
        await fetch_weights(js, elsewhere)


@pytest.mark.parametrize("shared_folder", [False, True], ids=["objstore", "folder"])
async def test_old_versions_are_pruned_so_the_store_never_fills(js, names, tmp_path, shared_folder):
    directory = tmp_path / "weights" if shared_folder else None
    blob = b"x" * (3 << 20)  # 12 versions of 3 MiB would overflow the 32 MiB test store
    events = []
    for version in range(1, 13):
        events.append(await publish_weights(js, names, version, blob, directory=directory, keep=2))
    for event in events[-2:]:
        assert await fetch_weights(js, event) == blob
    for event in events[:-2]:
        with pytest.raises(WeightsIntegrityError):
            await fetch_weights(js, event)
    if shared_folder:
        assert sorted(p.name for p in directory.iterdir()) == ["v11.safetensors", "v12.safetensors"]


async def test_a_blob_of_many_chunks_arrives_whole_and_in_order(js, names, monkeypatch):
    monkeypatch.setattr("broker.weights.PULL_BYTES", 8 * 1024)  # 8 chunks a pull: 13 pulls
    blob = bytes(range(256)) * 401  # 100 full 1 KiB chunks and a short last one
    event = await publish_weights(js, names, 1, blob, chunk_bytes=1024)
    assert await fetch_weights(js, event) == blob
    # Version 2 under the same store: the reader follows v2's chunks only.
    other = bytes(reversed(blob))
    assert (
        await fetch_weights(js, await publish_weights(js, names, 2, other, chunk_bytes=1024))
        == other
    )


async def test_fetch_apart_uses_its_own_connection_and_loop(broker, js, names):
    event = await publish_weights(js, names, 1, b"apart" * 1000)
    assert await fetch_weights_apart(broker.url, event) == b"apart" * 1000
    missing = event.model_copy(update={"location": f"objstore://{names.weights_store}/v7.x"})
    with pytest.raises(WeightsIntegrityError, match=r"weights v1: cannot read objstore://"):
        await fetch_weights_apart(broker.url, missing)


async def test_a_broker_that_cannot_answer_is_waited_for_not_blamed_on_the_blob(broker, nc, names):
    """A frozen broker (SIGSTOP) times the read out: a transient error that the worker's retry
    waits out, not a ``WeightsIntegrityError`` that gives the version up."""
    js = nc.jetstream(timeout=0.5)
    event = await publish_weights(js, names, 1, b"frozen" * 1000)
    async with frozen(broker.pid):
        with pytest.raises(TRANSIENT):
            await fetch_weights(js, event)
    assert await retry(lambda: fetch_weights(js, event), what="test") == b"frozen" * 1000


def test_the_newest_local_copy_is_read_off_the_version_folders(names, tmp_path):
    assert newest_local(tmp_path, names) == 0  # no folder yet
    run = tmp_path / names.run
    for name in ("v1", "v3", "v10.partial", "vx", "other"):
        (run / name).mkdir(parents=True)
    assert newest_local(tmp_path, names) == 3


async def test_a_run_of_the_same_name_provisioned_again_does_not_see_the_old_copies(
    js, names, tmp_path
):
    """Host-local copies are kept per run instance (the weights stream's creation): those left
    by an earlier run of the same name (or by one on another broker, on this host) are not
    taken for this run's versions by a starting trainer, nor removed by it."""
    from prometheus_client import CollectorRegistry, Histogram

    from broker.provision import provision_run
    from trainer.config import TrainerConfig
    from trainer.publisher import WeightPublisher
    from trainer.watch import ServingWatch

    first = await run_instance(js, names)
    assert await run_instance(js, names) == first  # one name for the run's life
    left = local_folder(tmp_path / first, names, 6)
    left.mkdir(parents=True)
    await js.delete_stream(names.weights_stream)
    await provision_run(js, names.run, SMALL_RUN)  # the same name, a new run
    second = await run_instance(js, names)
    assert second != first

    seconds = Histogram("t_publish_seconds", "test", ["path"], registry=CollectorRegistry())
    config = TrainerConfig(local_weights_dir=tmp_path)
    publisher = WeightPublisher(js, names, config, seconds, ServingWatch(30.0))
    assert await publisher.announced() == (0, False)  # not v6: that was the earlier run's
    publisher.close()
    await publisher.run()  # stops at once: nothing queued; removes this run's copies only
    assert left.is_dir()


def test_a_version_is_stored_once_a_live_worker_cannot_load_the_host_local_copy():
    """``trainer.publisher.store_needed``: workers on this node load the host-local copy (no
    upload); one on another node, or one here still behind after the grace, needs the store,
    and the latter is then treated as elsewhere at once."""
    import time

    from broker.messages import Role
    from broker.worker_messages import WorkerRegistered
    from trainer.publisher import LOCAL_GRACE_S, store_needed

    def worker(wid: str, host: str, version: int | None) -> WorkerRegistered:
        return WorkerRegistered(
            worker_id=wid, host=host, pid=1, role=Role.ROLLOUT, version=version,
            heartbeat_at=time.time(),
        )  # fmt: skip

    elsewhere: set[str] = set()
    here = [worker("a", "n1", 2), worker("b", "n1", 1)]
    assert not store_needed(2, [], "n1", 0.0, elsewhere)  # nobody to serve
    assert not store_needed(2, here, "n1", 0.0, elsewhere)  # b is loading the copy
    assert not store_needed(2, [worker("a", "n1", 2)], "n1", 60.0, elsewhere)  # all serve it
    assert store_needed(2, [*here, worker("c", "n2", 1)], "n1", 0.0, elsewhere)  # c: elsewhere
    assert not store_needed(2, [worker("c", "n2", 2)], "n1", 0.0, elsewhere)  # c has it
    assert not store_needed(2, [worker("d", "n1", None)], "n1", 0.0, elsewhere)
    assert store_needed(2, here, "n1", LOCAL_GRACE_S, elsewhere)  # b never loaded it
    assert elsewhere == {"b"}
    assert store_needed(3, [worker("b", "n1", 2)], "n1", 0.0, elsewhere)  # at once from now on
