"""The trainer group (``trainer.group``, ``tagsched.group``): ranks on several workers.

1. Two ranks that met through a store (as group members do) and took rank 0's state give the
   loss, gradients and weights after one optimizer step of one rank on the same batch.
   A member dying between two minibatches' updates leaves rank 0's model and optimizer as
   last committed (restored), with no gradient left behind.
2. A colocated group of three ``seamlessflow worker`` processes forms by KV rendezvous (no
   address given), trains; one non-zero rank is killed with SIGKILL mid-run and training goes
   on within a bound; then rank 0 is killed and the survivor takes over from the checkpoint; no
   sample is lost or trained twice over the whole run.
3. The multiplexed layout: a two-worker group plus a rollout worker; the scheduler lends the
   group's workers to rollout between batches and reclaims them; no sample lost or trained
   twice across the lends.
"""

import asyncio
import itertools
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from nats.js.errors import KeyNotFoundError
from safetensors.torch import load, save_file

from broker import codec
from broker.config import ConsumerLimits
from broker.control import TrainerGroup
from broker.provision import provision_run
from broker.subjects import RunNames
from seamlessflow.processes import worker_process
from tagsched.metrics import REGISTRY as SCHEDULER_METRICS
from tagsched.spec import Demand, Layout, PlacementSpec, layout_spec
from tests.support import SMALL_RUN, eventually, metric
from tests.test_liveness import TTL, leading
from tests.test_trainer import DP_CONFIG, dp_items, group, publish
from trainer import checkpoint
from trainer.config import TrainerConfig
from trainer.group import rendezvous_host

TOLERANCE = 1e-5
"""float32 on CPU: two ranks sum two partial gradients where one rank sums them in one
backward, so values differ in the last bits; 1e-5 absolute bounds loss, gradients and weights
after one step (observed differences about 1e-7)."""


# -- the record ----------------------------------------------------------------------------------
async def test_the_group_record_keeps_rank_0_and_outlives_its_scheduler(js, names):
    """Members keep their places and newcomers go last, so rank 0 stays while it is assigned;
    the same set in another order is no change; a scheduler taking over continues the
    generation it finds."""
    from tagsched.exceptions import LeaseLostError
    from tagsched.group import GroupRecord

    async def written() -> tuple[int, list[str]]:
        found = await _group(js, names)
        return found.generation, found.members

    record = GroupRecord(js, names)
    await record.follow(["a", "b"])
    assert await written() == (1, ["a", "b"])
    await record.follow(["b", "a"])  # assign put another first: the record keeps its order
    assert await written() == (1, ["a", "b"])
    await record.follow(["c", "b"])  # a left, c joined: b is rank 0 now, c last
    assert await written() == (2, ["b", "c"])
    takeover = GroupRecord(js, names)
    await takeover.follow(["c", "b"])
    assert await written() == (2, ["b", "c"])  # nothing changed: nothing written
    await takeover.follow(["b", "c", "d"])
    assert await written() == (3, ["b", "c", "d"])
    # the deposed scheduler cannot overwrite its successor's record: it stops leading
    with pytest.raises(LeaseLostError):
        await record.follow(["a"])
    assert await written() == (3, ["b", "c", "d"])


# -- 1. two ranks == one rank --------------------------------------------------------------------
def _warm(ranks, seed: int) -> None:
    """A solo step on other samples, so that the optimizer has state (rank 1's differs)."""
    samples = group(f"warm{seed}", 3, base=seed)
    from trainer.batcher import plan_step

    items, _, _ = plan_step([samples], 0, DP_CONFIG)
    ranks.step(items, 0)


def _loss_and_grads(backend, items) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard's loss and gradients, summed over the group (as ``apply`` sums)."""
    import torch.distributed as dist

    from trainer.batcher import collate
    from trainer.step import _loss_tokens, minibatch_loss

    total = sum(_loss_tokens(i) for i in items)
    rank, size = backend.dp_rank, backend.dp_size
    shard = collate(items[rank::size], backend.row_tokens, backend.shares_prefixes)
    terms, _ = minibatch_loss(backend, shard, total, DP_CONFIG)
    terms.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
    loss = terms.loss.detach().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(loss)
        dist.all_reduce(grads)
    backend.optimizer.zero_grad(set_to_none=True)
    return loss, grads


def _joined(rank: int, port: int, model: str, config: TrainerConfig, stale_part: bool = False):
    """This process as rank ``rank`` of a group of two, met at ``port``, with rank 0's state
    (rank 1 warmed up on other samples first: the join must replace its state; with
    ``stale_part`` it also computed part of a step alone: the join must drop its gradients)."""
    import torch.distributed as dist

    from trainer.ranks import RankGroup

    torch.set_num_threads(1)
    ranks = RankGroup(Path(model), config)
    _warm(ranks, seed=rank)
    if stale_part:
        ranks.accumulate(dp_items()[:3])
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    ranks.join(store, rank, 2, timeout)
    return ranks


def _group_rank(rank: int, port: int, model: str, out: str, ahead: bool) -> None:
    ranks = _joined(rank, port, model, DP_CONFIG, stale_part=ahead and rank == 1)
    loss, grads = _loss_and_grads(ranks.backend, dp_items())
    if rank == 0:
        if ahead:  # the step computed in two parts (``trainer.overlap``), then committed
            items = dp_items()
            ranks.accumulate(items[:2])
            ranks.accumulate(items[2:])
            ranks.commit(0)
        else:
            ranks.step(dp_items(), 0)
        ranks.leave()
    else:
        busy: list[bool] = []
        ranks.follow_group(busy.append)  # until rank 0 leaves
        Path(f"{out}/busy.json").write_text(json.dumps(busy))
    tensors = {"loss": loss, "grads": grads, **ranks.backend.hf_state_dict()}
    save_file(tensors, f"{out}/rank{rank}.safetensors")


@pytest.mark.parametrize("ahead", [False, True], ids=["step", "computed-ahead"])
def test_two_ranks_give_one_ranks_loss_gradients_and_step(tiny_model_dir, tmp_path, ahead):
    from tests.support import free_port
    from trainer.ranks import RankGroup

    torch.multiprocessing.spawn(
        _group_rank,
        args=(free_port(), str(tiny_model_dir), str(tmp_path), ahead),
        nprocs=2,
        join=True,
    )
    single = RankGroup(tiny_model_dir, DP_CONFIG)
    _warm(single, seed=0)
    before = checkpoint.snapshot(single.backend.hf_state_dict())  # a copy: the model's own
    loss, grads = _loss_and_grads(single.backend, dp_items())
    single.step(dp_items(), 0)
    one = {"loss": loss, "grads": grads, **single.backend.hf_state_dict()}
    ranks = [load((tmp_path / f"rank{r}.safetensors").read_bytes()) for r in range(2)]
    # rank 1 said it was busy while it trained each command (accumulate, accumulate, commit)
    commands = 3 if ahead else 1
    assert json.loads((tmp_path / "busy.json").read_text()) == [True, False] * commands
    moved = max(float((one[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-3  # the step did something, so the comparison below means something
    assert float(grads.abs().max()) > 1e-3
    for name, tensor in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], tensor, atol=TOLERANCE, rtol=0), name


# -- 2. a colocated group of worker processes, one rank killed ---------------------------------
COLLECTIVE_TIMEOUT = 5.0
RESUME_BOUND = 30.0
"""From the kill to the next committed version: the dead member found at once (its socket
closes), one more rendezvous at the old membership (up to ``COLLECTIVE_TIMEOUT``) while the
scheduler waits out ``TTL``, a rendezvous of the survivors, the state sent, one step; on 2
shared cores, with room."""


async def _run(
    js, run_name: str, tmp_path: Path, groups_per_step: int = 1
) -> tuple[RunNames, Path, Path]:
    """A run whose registry entries go stale within ``TTL``; the workers' config file (one
    checkpoint folder for all, as ``seamlessflow run`` gives them) and that folder."""
    limits = ConsumerLimits(ack_wait_s=5, max_deliver=20, max_ack_pending=8192)
    provision = SMALL_RUN.model_copy(update={"trainer": limits, "workers_ttl_s": TTL})
    await provision_run(js, run_name, provision)
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "worker.toml"
    config.write_text(
        f'[trainer]\ncheckpoint_dir = "{ckpt}"\nlocal_weights_dir = "{tmp_path / "shm"}"\n'
        f"groups_per_step = {groups_per_step}\nlr = 1e-3\nmax_staleness = 1000\nthreads = 1\n"
        "checkpoint_every = 1\n"
        f"collective_timeout_s = {COLLECTIVE_TIMEOUT}\n"
    )
    return RunNames(run_name), config, ckpt


def _workers(url: str, names: RunNames, model: Path, config: Path, tags: dict[str, str]):
    return {
        wid: worker_process(
            url, names.run, model, wid, "--tags", t, "--heartbeat-s", "0.5", "--config", str(config)
        )
        for wid, t in tags.items()
    }


async def _group(js, names: RunNames) -> TrainerGroup | None:
    bucket = await js.key_value(names.state_kv)
    try:
        return codec.decode(TrainerGroup, (await bucket.get(RunNames.TRAINER_GROUP_KEY)).value)
    except KeyNotFoundError:
        return None


def _trained(ckpt: Path) -> list[str]:
    return [sid for step in checkpoint.read_steps(ckpt) for sid in step.trained]


def _check_once(ckpt: Path, everything: set[str]) -> None:
    """Every sample trained exactly once; versions one after another (but where a killed rank 0's
    checkpoint write was cut after its version was announced: at most 3 on)."""
    steps = checkpoint.read_steps(ckpt)
    trained = _trained(ckpt)
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == everything, f"lost: {sorted(everything - set(trained))}"
    versions = [0, *(s.version for s in steps)]
    assert all(0 < b - a <= 3 for a, b in itertools.pairwise(versions)), versions


def _stop(procs) -> None:
    for p in procs:
        p.stop()


@pytest.mark.newest_nats
async def test_a_colocated_group_forms_by_rendezvous_and_survives_killed_ranks(
    broker, nc, js, run_name, tiny_model_dir, tmp_path
):
    names, config, ckpt = await _run(js, run_name, tmp_path)
    tags = {f"g{i}": "train,rollout" for i in range(3)}
    procs = _workers(broker.url, names, tiny_model_dir, config, tags)
    everything: set[str] = set()
    try:
        await asyncio.gather(*(asyncio.to_thread(p.wait_ready) for p in procs.values()))
        # Every worker tagged both trains (no lending here: item 3 lends).
        spec = PlacementSpec(train=Demand(tags=["train", "rollout"]), rollout=Demand(
            tags=["rollout"], count=0))  # fmt: skip
        async with leading(nc, names, spec):
            first = [group(f"a{i}", 2, base=i) for i in range(40)]
            everything |= {s.sample_id for g in first for s in g}
            await eventually(lambda: _group(js, names), timeout=30)
            members = (await _group(js, names)).members
            assert sorted(members) == sorted(tags)
            leader = procs[members[0]].metrics_url
            await publish(js, names, *[s for g in first for s in g])
            await eventually(lambda: len(checkpoint.read_steps(ckpt)) >= 3, timeout=60)
            # Formed once, by KV rendezvous, with three ranks.
            assert await metric(leader, "sf_trainer_group_size") == 3
            assert await metric(leader, "sf_trainer_group_rendezvous_seconds_count") >= 1
            follower = procs[members[1]].metrics_url
            assert await metric(follower, "sf_trainer_rank_step_seconds_count") >= 1
            assert await metric(follower, "sf_trainer_group_rank") == 1
            victim = members[2]
            procs[victim].stop(signal.SIGKILL)
            killed_at = time.monotonic()

            async def regrouped_of_two() -> bool:
                return (await _group(js, names)).members == members[:2]

            # The survivors go on as a group of two at a new generation (a step or two the
            # three took before the kill may still be committing: not a step of the two).
            await eventually(regrouped_of_two, timeout=RESUME_BOUND)
            steps_at_regroup = len(checkpoint.read_steps(ckpt))
            await eventually(
                lambda: len(checkpoint.read_steps(ckpt)) > steps_at_regroup + 1,
                timeout=RESUME_BOUND,
            )
            resumed_s = time.monotonic() - killed_at
            regrouped = await _group(js, names)
            assert await metric(leader, "sf_trainer_group_size") == 2
            assert await metric(leader, "sf_trainer_group_generation") == regrouped.generation
            # Rank 0 itself killed mid-run: the survivor becomes rank 0, resumes from the
            # shared checkpoint folder, and the samples the dead one held come back to it.
            later = [group(f"b{i}", 2, base=i) for i in range(20)]
            everything |= {s.sample_id for g in later for s in g}
            await publish(js, names, *[s for g in later for s in g])
            at = len(checkpoint.read_steps(ckpt))
            await eventually(lambda: len(checkpoint.read_steps(ckpt)) >= at + 2, timeout=60)
            procs[members[0]].stop(signal.SIGKILL)
            await eventually(lambda: set(_trained(ckpt)) >= everything, timeout=90)
            assert (await _group(js, names)).members == [members[1]]
            successor = procs[members[1]].metrics_url
            assert await metric(successor, "sf_trainer_group_rank") == 0
            print(f"next version {resumed_s:.1f} s after the kill")
    finally:
        _stop(procs.values())
    _check_once(ckpt, everything)


# -- 3. lending a trainer group ------------------------------------------------------------------
BATCHES = 4


def _count(name: str) -> float:
    return SCHEDULER_METRICS.get_sample_value(name) or 0.0


@pytest.mark.newest_nats
async def test_the_multiplexed_layout_lends_the_trainer_group_and_loses_no_sample(
    broker, nc, js, run_name, tiny_model_dir, tmp_path
):
    names, config, ckpt = await _run(js, run_name, tmp_path, groups_per_step=2)
    tags = {"g0": "train,rollout", "g1": "train,rollout", "r0": "rollout"}
    procs = _workers(broker.url, names, tiny_model_dir, config, tags)
    everything: set[str] = set()
    lends, reclaims = (_count(f"sf_scheduler_{k}_seconds_count") for k in ("lend", "reclaim"))
    try:
        await asyncio.gather(*(asyncio.to_thread(p.wait_ready) for p in procs.values()))
        spec = layout_spec(Layout.MULTIPLEXED, train_workers=2)
        # Lend whenever the trainer waits longer than a switch: every gap between batches.
        quick = {"lend_gain": 1.0, "switch_cost_s": 0.1, "rate_window_s": 1.0}
        async with leading(nc, names, spec, **quick):
            await eventually(lambda: _group(js, names), timeout=30)
            group_record = await _group(js, names)
            assert sorted(group_record.members) == ["g0", "g1"]
            leader = procs[group_record.members[0]].metrics_url
            # The workers start as rollout (the role a lent worker has); each batch takes them
            # back, and each wait for the next lends them again.
            for batch in range(BATCHES):
                samples = [s for i in range(2) for s in group(f"m{batch}-{i}", 2, base=i)]
                everything |= {s.sample_id for s in samples}
                await publish(js, names, *samples)
                want = frozenset(everything)
                await eventually(lambda w=want: set(_trained(ckpt)) >= w, timeout=60)
                # The group waits for the next batch: both its workers are lent to rollout.
                lent = lends + 2 * (batch + 1)
                await eventually(
                    lambda n=lent: _count("sf_scheduler_lend_seconds_count") >= n, timeout=30
                )
            # Reclaimed before each batch but the first; one generation, formed once.
            assert _count("sf_scheduler_reclaim_seconds_count") >= reclaims + 2 * (BATCHES - 1)
            assert await _group(js, names) == group_record
            assert await metric(leader, "sf_trainer_group_reforms_total", cause="membership") == 1
            assert await metric(leader, "sf_trainer_group_reforms_total", cause="failure") == 0
            follower = procs[group_record.members[1]].metrics_url
            assert await metric(follower, "sf_trainer_rank_step_seconds_count") >= BATCHES
    finally:
        _stop(procs.values())
    _check_once(ckpt, everything)


MINIBATCHES = TrainerConfig(**{**DP_CONFIG.model_dump(), "groups_per_step": 2, "minibatches": 2})


def _counting(backend) -> list[int]:
    """Count ``backend``'s completed optimizer updates."""
    done: list[int] = []
    apply = backend.apply

    def counted(loss):
        stats = apply(loss)
        done.append(1)
        return stats

    backend.apply = counted
    return done


def _dying_rank(rank: int, port: int, model: str) -> None:
    import copy

    import torch.distributed as dist

    from trainer.exceptions import GroupBrokenError

    ranks = _joined(rank, port, model, MINIBATCHES)
    backend = ranks.backend
    done = _counting(backend)
    if rank == 1:
        # An injected fault: this rank dies between the two minibatches' updates (after the
        # first all-reduce, before the second), as a killed member would.
        apply = backend.apply
        backend.apply = lambda loss: os._exit(0) if done else apply(loss)
        ranks.follow_group()
        raise AssertionError("rank 1 outlived its second update")
    committed = copy.deepcopy(backend.state())
    with pytest.raises(GroupBrokenError):
        ranks.step(dp_items(), 0)
    assert done == [1]  # the first minibatch's update had landed: restoring was needed
    state = backend.state()
    for name, tensor in committed["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    for index, entries in committed["optimizer"]["state"].items():
        for name, tensor in entries.items():
            assert torch.equal(state["optimizer"]["state"][index][name], tensor), (index, name)
    assert all(p.grad is None for p in backend.model.parameters())  # none left to add up
    assert not dist.is_initialized() and not ranks.grouped


def test_a_member_dying_mid_step_leaves_rank_0_as_last_committed(tiny_model_dir):
    """With two minibatches the first update lands before the second collective fails: rank 0
    restores the model and optimizer as they were before the step, with no gradient left."""
    from tests.support import free_port

    torch.multiprocessing.spawn(
        _dying_rank, args=(free_port(), str(tiny_model_dir)), nprocs=2, join=True
    )


def _dying_ahead(rank: int, port: int, model: str) -> None:
    import copy

    import torch.distributed as dist

    from trainer.exceptions import GroupBrokenError
    from trainer.step import Accumulation

    ranks = _joined(rank, port, model, DP_CONFIG)
    items = dp_items()
    if rank == 1:
        # An injected fault: this rank dies computing the step's second part, as a killed
        # member would, before rank 0 commits.
        add = Accumulation.add
        parts: list[int] = []

        def dying(self, backend, part, config):
            parts.append(1)
            if len(parts) == 2:
                os._exit(0)
            add(self, backend, part, config)

        Accumulation.add = dying
        ranks.follow_group()
        raise AssertionError("rank 1 outlived its second part")
    committed = copy.deepcopy(ranks.backend.state())
    with pytest.raises(GroupBrokenError):
        ranks.accumulate(items[:2])
        ranks.accumulate(items[2:])
        ranks.commit(0)
    state = ranks.backend.state()
    for name, tensor in committed["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    assert all(p.grad is None for p in ranks.backend.model.parameters())  # none left to add up
    assert not dist.is_initialized() and not ranks.grouped


def test_a_member_dying_while_a_step_is_computed_ahead_leaves_no_gradient(tiny_model_dir):
    """``trainer.overlap``: a member lost before the commit breaks the group at the next
    collective; rank 0 keeps its last committed weights and drops the parts it computed."""
    from tests.support import free_port

    torch.multiprocessing.spawn(
        _dying_ahead, args=(free_port(), str(tiny_model_dir)), nprocs=2, join=True
    )


def test_rank_0_is_reached_at_its_pods_address_where_kubernetes_gives_it(monkeypatch):
    """On Kubernetes a pod's ports are on its own address, not its node's (``$NODE_NAME``, what
    the registry names): the rendezvous host is ``$POD_IP`` there, else the node's name."""
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.delenv("POD_IP", raising=False)
    assert rendezvous_host() == "gpu-node-7"
    monkeypatch.setenv("POD_IP", "10.4.2.17")
    assert rendezvous_host() == "10.4.2.17"


def test_a_join_waiting_for_members_that_never_come_does_not_hold_up_leaving(tiny_model_dir):
    """A worker stopping while its group's rendezvous waits for members that stopped first
    (``seamlessflow run`` stopped them one after another then) leaves at once: its leave waited for
    the join's timeout (a minute per rank, stopping a 5-worker trainer group took 2 minutes).
    In a process of its own: a failed ``init_process_group`` advances torch's group count, and
    a later group formed in this process would wait on other keys than its fresh peer's."""
    torch.multiprocessing.spawn(_leave_while_joining, args=(str(tiny_model_dir),), nprocs=1)


def _leave_while_joining(_: int, model: str) -> None:
    import threading

    import torch.distributed as dist

    from tests.support import free_port
    from trainer.exceptions import GroupBrokenError
    from trainer.ranks import RankGroup

    torch.set_num_threads(1)
    ranks = RankGroup(Path(model), DP_CONFIG)
    port, timeout = free_port(), timedelta(seconds=4)
    master = dist.TCPStore(
        "127.0.0.1", port, 3, is_master=True, timeout=timeout, wait_for_workers=False
    )
    member = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timeout)
    failed: list[BaseException] = []

    def join() -> None:
        try:
            ranks.join(member, 1, 3, timeout)  # ranks 0 and 2 never come
        except (GroupBrokenError, RuntimeError) as exc:
            failed.append(exc)

    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    time.sleep(1.0)  # the join holds the lock, waiting for the others
    assert joining.is_alive()
    started = time.monotonic()
    ranks.leave()
    assert time.monotonic() - started < 1.0
    joining.join(timeout=30)  # its own timeout ends it
    assert failed and not ranks.grouped and not dist.is_initialized()
    del master


async def test_a_blocking_join_on_its_daemon_thread_gives_way_to_stop():
    """Rank 0's and the followers' joins (``on_daemon_thread``): a stop ends the wait at once,
    the blocked thread is a daemon (the process exits without it), and what the call raises
    reaches the caller."""
    import threading

    from trainer.group import on_daemon_thread

    release, stop = threading.Event(), asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    started = time.monotonic()
    assert await on_daemon_thread(release.wait, "blocked", stop) is False
    assert time.monotonic() - started < 2.0
    blocked = next(t for t in threading.enumerate() if t.name == "blocked")
    assert blocked.daemon and blocked.is_alive()
    release.set()

    def broken() -> None:
        raise RuntimeError("rendezvous timed out")

    with pytest.raises(RuntimeError, match="timed out"):
        await on_daemon_thread(broken, "broken", asyncio.Event())
    assert await on_daemon_thread(lambda: None, "fine", asyncio.Event()) is True


async def test_a_joins_outcome_after_the_stop_is_dropped_not_left_unretrieved():
    """A follower stopped while its thread still waits for rank 0 fails there later (rank 0
    gone): that error reaches nobody, and asyncio must not log it as a future's exception never
    retrieved (an ERROR line in every stopping worker)."""
    import gc
    import threading

    from trainer.group import on_daemon_thread

    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    release, stop = threading.Event(), asyncio.Event()
    stop.set()

    def fails_later() -> None:
        release.wait()
        raise RuntimeError("lost rank 0")

    try:
        assert await on_daemon_thread(fails_later, "late", stop) is False
        release.set()
        next(t for t in threading.enumerate() if t.name == "late").join(5)
        await asyncio.sleep(0.1)  # the thread's outcome reaches the loop
        gc.collect()
        assert reported == []
    finally:
        loop.set_exception_handler(None)


def test_a_member_whose_join_timed_out_forms_a_group_with_a_fresh_one(tiny_model_dir):
    """A worker whose rendezvous timed out (its peer never came) forms the next group with a
    freshly started member. torch names an unnamed group by a count of the groups its process
    made, which the failed ``init_process_group`` advanced: the two waited at different keys of
    rank 0's store until their timeout. In processes of their own, fresh ones."""
    from tests.support import free_port

    ports = (free_port(), free_port())
    torch.multiprocessing.spawn(
        _join_after_a_failed_join, args=(*ports, str(tiny_model_dir)), nprocs=2, join=True
    )


def _join_after_a_failed_join(rank: int, first: int, second: int, model: str) -> None:
    import torch.distributed as dist

    from trainer.ranks import RankGroup

    torch.set_num_threads(1)
    ranks = RankGroup(Path(model), DP_CONFIG)
    timeout = timedelta(seconds=30)
    if rank == 0:
        short = timedelta(seconds=2)
        alone = dist.TCPStore(
            "127.0.0.1", first, 2, is_master=True, timeout=short, wait_for_workers=False
        )
        with pytest.raises(RuntimeError):
            ranks.join(alone, 0, 2, short)
        store = dist.TCPStore(
            "127.0.0.1", second, 2, is_master=True, timeout=timeout, wait_for_workers=False
        )
    else:  # fresh: its client connects once rank 0 opens its second store
        store = dist.TCPStore("127.0.0.1", second, 2, is_master=False, timeout=timeout)
    started = time.monotonic()
    ranks.join(store, rank, 2, timeout)
    assert ranks.grouped and dist.get_world_size() == 2
    assert time.monotonic() - started < 20.0
    if rank == 0:
        ranks.leave()
    else:
        ranks.follow_group()  # returns at rank 0's leave
    assert not dist.is_initialized()
