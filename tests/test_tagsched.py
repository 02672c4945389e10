"""The tag scheduler: placement specs, lending, admission, role changes with epochs, fencing and
failover, on a real broker with real worker and scheduler processes."""

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from nats.errors import NoRespondersError
from nats.js.api import ConsumerConfig, ConsumerInfo, SequenceInfo

from broker import codec
from broker.client import session
from broker.messages import (
    ChatMessage,
    Role,
    SampleReady,
    SessionEnded,
    TaskSubmitted,
    WeightsState,
)
from broker.node_tags import gpu_tags, query_gpus, with_node_tags
from broker.provision import provision_run
from broker.registry import Registration, node_name
from broker.roles import membership
from broker.server import EmbeddedBroker
from broker.subjects import Durable, RunNames
from broker.worker_messages import (
    RoleChangeAcked,
    RoleChangeRequested,
    TrainerShape,
    WorkerRegistered,
    has_tags,
)
from rollout.gateway import Gateway
from seamlessflow.config import load_config
from seamlessflow.exceptions import ConfigError
from seamlessflow.flags import add_flags, apply_flags, section_flags
from seamlessflow.processes import ServiceProcess, worker_process
from seamlessflow.submit import submit_tasks
from tagsched.admission import Admission, Stamper, admission_limit, admission_state
from tagsched.config import LayoutConfig, SchedulerConfig
from tagsched.exceptions import AdmissionError, LeaseLostError, UnsatisfiableSpecError
from tagsched.lending import LendingPolicy, RateMeter, trainer_roles
from tagsched.metrics import REGISTRY
from tagsched.scheduler import Scheduler
from tagsched.spec import (
    Assignment,
    Demand,
    Layout,
    PlacementSpec,
    assign,
    layout_spec,
)
from tagsched.state import StateStore
from tests.support import (
    MODEL,
    SMALL_RUN,
    admitting,
    broker_config,
    building,
    consumer_settled,
    eventually,
    free_port,
    gateway_config,
    metric,
    own_run,
    publish_call,
    record,
    registered,
    serving,
    stream_messages,
)

# -- placement specs (pure) --------------------------------------------------------------------


def worker(wid: str, *tags: str, role: Role = Role.IDLE, capacity: int = 1) -> WorkerRegistered:
    return WorkerRegistered(
        worker_id=wid,
        host="h",
        pid=1,
        tags=list(tags),
        role=role,
        capacity=capacity,
        heartbeat_at=time.time(),
    )


def fleet(*workers: WorkerRegistered) -> dict[str, WorkerRegistered]:
    return {w.worker_id: w for w in workers}


def test_tags_match_by_key_or_by_key_and_value():
    assert has_tags(["train", "gpu=0"], ["gpu"])
    assert has_tags(["train", "gpu=0"], ["gpu=0", "train"])
    assert not has_tags(["train", "gpu=0"], ["gpu=1"])
    assert not has_tags(["gpus=0"], ["gpu"])


def test_the_three_layouts_are_three_specs_of_one_assignment():
    split = fleet(worker("t", "train"), worker("r1", "rollout"), worker("r2", "rollout"))
    a = assign(layout_spec(Layout.DISAGGREGATED), split)
    assert (a.train, a.rollout, a.lendable, a.idle) == (["t"], ["r1", "r2"], [], [])
    # Multiplexed: the trainer's worker is also tagged rollout, and is lendable.
    mux = fleet(worker("t", "train", "rollout"), worker("r1", "rollout"))
    a = assign(layout_spec(Layout.MULTIPLEXED), mux)
    assert (a.train, a.rollout, a.lendable) == (["t"], ["r1"], ["t"])
    assert assign(layout_spec(Layout.DISAGGREGATED), mux).lendable == []
    # Colocated: every worker tagged both; one trains (lendable), the others generate.
    both = fleet(worker("a", "train", "rollout"), worker("b", "train", "rollout"))
    a = assign(layout_spec(Layout.COLOCATED), both)
    assert (a.train, a.rollout, a.lendable) == (["a"], ["b"], ["a"])
    # A single colocated worker is enough: it is lent whenever the trainer waits.
    assert assign(layout_spec(Layout.COLOCATED), fleet(worker("a", "train", "rollout"))).train


def test_assignment_is_stable_and_prefers_dedicated_trainers():
    both = fleet(worker("a", "train", "rollout"), worker("b", "train", "rollout", role=Role.TRAIN))
    assert assign(layout_spec(Layout.COLOCATED), both).train == ["b"]  # b trains already
    mixed = fleet(worker("a", "train", "rollout"), worker("z", "train"))
    assert assign(layout_spec(Layout.MULTIPLEXED), mixed).train == ["z"]  # fewest other tags


def test_a_lent_trainer_keeps_its_place_when_a_newcomer_could_train():
    # "t" trains, lent to rollout (it holds rollout now); "a" joins, first by id
    lent = fleet(
        worker("t", "train", "rollout", role=Role.ROLLOUT), worker("a", "train", "rollout")
    )
    spec = layout_spec(Layout.MULTIPLEXED)
    assert assign(spec, lent).train == ["a"]  # without the group's members: the trainer moves
    assert assign(spec, lent, training=["t"]).train == ["t"]
    assert assign(spec, lent, training=["t"]).lendable == ["t"]


def test_unsatisfiable_specs_name_the_missing_tags():
    only_rollout = fleet(worker("r1", "rollout"))
    with pytest.raises(UnsatisfiableSpecError, match=r"train needs 1 worker\(s\) tagged \{train\}"):
        assign(layout_spec(Layout.DISAGGREGATED), only_rollout)
    only_train = fleet(worker("t", "train"))
    with pytest.raises(UnsatisfiableSpecError, match=r"rollout needs 1 worker\(s\) tagged"):
        assign(layout_spec(Layout.DISAGGREGATED), only_train)
    with pytest.raises(UnsatisfiableSpecError, match=r"tagged \{train,rollout\}"):
        assign(layout_spec(Layout.COLOCATED), fleet(worker("t", "train"), worker("r", "rollout")))
    # A serving-only spec needs no trainer.
    serving = PlacementSpec(train=Demand(tags=["train"], count=0))
    assert assign(serving, only_rollout).rollout == ["r1"]


# -- placement by the user's tags (pure) -----------------------------------------------------------


def layout(**tables) -> PlacementSpec:
    """The spec of a ``[layout]`` table."""
    return LayoutConfig.model_validate(tables).spec()


GPUS = fleet(
    worker("h1", "train", "rollout", "gpu=h200"),
    worker("h2", "train", "rollout", "gpu=h200"),
    worker("l1", "train", "rollout", "gpu=l4"),
    worker("l2", "rollout", "gpu=l4"),
    worker("c1", "rollout"),
)


def test_demands_put_the_trainer_on_the_tagged_workers_and_rollout_on_the_rest():
    # The kind alone trains one worker (h1, by id), whatever its GPU.
    assert assign(layout(), GPUS).train == ["h1"]
    a = assign(layout(train={"tags": ["gpu=h200"], "count": 2}, rollout={"count": "rest"}), GPUS)
    assert (a.train, a.rollout, a.idle) == (["h1", "h2"], ["c1", "l1", "l2"], [])
    # rollout on the L4s only: the untagged worker is idle; a bare key matches any value.
    a = assign(layout(train={"tags": ["gpu=h200"], "count": 2}, rollout={"tags": ["gpu=l4"]}), GPUS)
    assert (a.rollout, a.idle) == (["l1", "l2"], ["c1"])
    a = assign(layout(train={"tags": ["gpu=h200"], "count": 2}, rollout={"tags": ["gpu"]}), GPUS)
    assert (a.rollout, a.idle) == (["l1", "l2"], ["c1"])
    # "rest" for train: every worker that has the tags trains (data parallel).
    assert assign(layout(train={"tags": ["gpu=h200"], "count": "rest"}), GPUS).train == ["h1", "h2"]
    # Multiplexed with demands: the H200 trainers are lendable, rollout still the rest.
    a = assign(layout(kind="multiplexed", train={"tags": ["gpu=h200"], "count": 2}), GPUS)
    assert (a.train, a.lendable, a.rollout) == (["h1", "h2"], ["h1", "h2"], ["c1", "l1", "l2"])


def test_the_kinds_are_shorthands_the_tables_refine():
    for kind in Layout:
        assert layout(kind=kind.value) == layout_spec(kind)
    spec = layout(kind="colocated", train={"tags": ["gpu=h200"]}, rollout={"count": 2})
    assert spec.train == Demand(tags=["train", "rollout", "gpu=h200"], count=1)
    assert spec.rollout == Demand(tags=["rollout"], count=2) and spec.lend
    assert layout(train={"tags": ["train"], "count": 0}).train == Demand(tags=["train"], count=0)


def test_capacity_weights_the_choice_when_fewer_workers_are_wanted_than_match():
    pool = fleet(
        worker("a", "train", "rollout", capacity=64),
        worker("b", "train", "rollout", capacity=8),
        worker("c", "rollout", capacity=16),
        worker("d", "rollout", capacity=128),
    )
    # rollout takes the largest of those left; capacity does not pick the trainer (by id here).
    a = assign(layout(train={"count": 1}, rollout={"count": 2}), pool)
    assert (a.train, a.rollout, a.idle) == (["a"], ["c", "d"], ["b"])
    # A worker serving already keeps serving before capacity counts (no churn on a join).
    pool["b"] = worker("b", "train", "rollout", capacity=8, role=Role.ROLLOUT)
    a = assign(layout(train={"count": 1}, rollout={"count": 2}), pool)
    assert (a.train, a.rollout, a.idle) == (["a"], ["b", "d"], ["c"])


def test_an_unsatisfiable_demand_names_the_missing_tags_and_what_the_workers_have():
    spec = layout(train={"tags": ["gpu=h200"], "count": 3})
    with pytest.raises(UnsatisfiableSpecError) as caught:
        assign(spec, GPUS)
    assert str(caught.value) == (
        "train needs 3 worker(s) tagged {train,gpu=h200}; 2 of the live workers are: "
        "c1{rollout} lacks {train,gpu=h200}, h1{train,rollout,gpu=h200}, "
        "h2{train,rollout,gpu=h200}, l1{train,rollout,gpu=l4} lacks {gpu=h200}, "
        "l2{rollout,gpu=l4} lacks {train,gpu=h200}"
    )
    with pytest.raises(
        UnsatisfiableSpecError,
        match=r"rollout needs 1 worker\(s\) tagged "
        r"\{rollout,gpu=a100\}.* l2\{rollout,gpu=l4\} lacks \{gpu=a100\}",
    ):
        assign(layout(rollout={"tags": ["gpu=a100"]}), GPUS)
    with pytest.raises(UnsatisfiableSpecError, match=r"rollout needs 5 worker\(s\)"):
        assign(layout(rollout={"count": 5}), GPUS)  # 4 besides the trainer


def test_layout_tables_parse_from_toml_and_flags_and_refuse_bad_input(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[layout]\nkind = "multiplexed"\n'
        '[layout.train]\ntags = ["gpu=h200"]\ncount = 2\n'
        '[layout.rollout]\ntags = "gpu=l4,node=b"\ncount = "rest"\n'
    )
    config = load_config(path).layout
    assert config.spec() == PlacementSpec(
        train=Demand(tags=["train", "gpu=h200"], count=2),
        rollout=Demand(tags=["rollout", "gpu=l4", "node=b"]),
        lend=True,
    )
    parser = argparse.ArgumentParser()
    flags = section_flags("layout")
    add_flags(parser, flags)
    given = ["--train-tags", "gpu=h200", "--train-count", "2", "--rollout-count", "rest"]
    spec = apply_flags(load_config(None), parser.parse_args(given), flags).layout.spec()
    assert spec.train == Demand(tags=["train", "gpu=h200"], count=2)
    assert spec.rollout == Demand(tags=["rollout"])
    for table, error in [
        (
            "[layout.train]\ncount = 'all'",
            "layout.train.count\n  Value error, count is a number of "
            "workers (0 or more) or 'rest' (every remaining worker that has the tags), not 'all'",
        ),
        ("[layout.rollout]\ncount = -1", "not -1"),
        ("[layout.train]\ntag = ['gpu']", "layout.train.tag\n  Extra inputs are not permitted"),
        ("[layout.train]\ntags = ['gpu h200']", "layout.train.tags.0\n  String should match"),
    ]:
        path.write_text(table + "\n")
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert error in str(caught.value), caught.value
    args = parser.parse_args(["--rollout-count", "most"])
    with pytest.raises(ConfigError, match="--rollout-count 'most': Value error, count is a number"):
        apply_flags(load_config(None), args, flags)


# -- node tags (pure, and the absent nvidia-smi of this machine) -----------------------------------

NVIDIA_SMI = {  # nvidia-smi --query-gpu=name --format=csv,noheader, as captured on such nodes
    "NVIDIA H200\nNVIDIA H200\nNVIDIA H200\nNVIDIA H200\n": ["gpu=h200"],
    "NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n": ["gpu=h100"],
    "NVIDIA A100-SXM4-80GB\n": ["gpu=a100"],
    "NVIDIA L4\n": ["gpu=l4"],
    "Tesla V100-SXM2-16GB\n": ["gpu=v100"],
    "NVIDIA GeForce RTX 4090\nNVIDIA RTX A6000\n": ["gpu=rtx4090", "gpu=rtxa6000"],
    "": [],
    "\n": [],
}


def test_gpu_tags_are_read_from_nvidia_smi_output():
    for output, tags in NVIDIA_SMI.items():
        assert gpu_tags(output) == tags, output


def test_node_tags_are_added_unless_the_user_gave_that_key(tmp_path, monkeypatch):
    assert with_node_tags(["rollout"], "n1", "NVIDIA H200\n") == ["rollout", "node=n1", "gpu=h200"]
    mine = ["rollout", "gpu=big", "node=rack3"]  # explicit node=/gpu= win
    assert with_node_tags(mine, "n1", "NVIDIA H200\n") == mine
    assert with_node_tags(["train"], "n1", "") == ["train", "node=n1"]  # no GPU: no gpu= tag
    assert with_node_tags(["train", "gpu"], "n1", "NVIDIA L4\n") == [
        "train",
        "gpu",
        "node=n1",
        "gpu=l4",
    ]
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here (none on this machine at all)
    assert query_gpus() == ""
    # A node whose driver is gone: nvidia-smi fails (a stand-in script, the failure injected).
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    assert query_gpus() == ""


async def test_a_registration_carries_its_nodes_tags(js, names):
    r = await Registration.open(js, names, "n1", tags=["rollout"], role=Role.IDLE)
    await r.put()
    entry = await registered(js, names, "n1")
    assert entry.tags[:2] == ["rollout", f"node={node_name()}"] and entry.host == node_name()
    gpus = [t for t in entry.tags if t.startswith("gpu=")]
    assert gpus == gpu_tags(query_gpus())  # none on a machine without nvidia-smi


def test_lending_needs_a_gain_over_the_switch_cost_and_reclaims_ahead_of_the_batch():
    policy = LendingPolicy(gain=2.0, assumed_cost_s=1.0)  # 0.5 s lend + 0.5 s reclaim assumed
    # 4 groups missing at 1 group/s: a 4 s wait > 2 x 1 s: lend.
    assert policy.lent(now_lent=False, missing_groups=4, groups_per_s=1.0)
    # 1.5 s wait < 2 s: not worth a switch there and back.
    assert not policy.lent(now_lent=False, missing_groups=1.5, groups_per_s=1.0)
    # Nothing arriving: the trainer would wait for ever; lend.
    assert policy.lent(now_lent=False, missing_groups=1, groups_per_s=0.0)
    # Lent: kept while the batch is further away than a reclaim (0.5 s) ...
    assert policy.lent(now_lent=True, missing_groups=1, groups_per_s=1.0)
    # ... reclaimed once it will be ready within it, and always once it is ready.
    assert not policy.lent(now_lent=True, missing_groups=0.4, groups_per_s=1.0)
    assert not policy.lent(now_lent=True, missing_groups=0, groups_per_s=0.0)
    # Measured switches replace the assumption.
    policy.lends.extend([2.0, 2.0])
    policy.reclaims.extend([3.0])
    assert policy.switch_cost() == 5.0 and policy.reclaim_cost() == 3.0
    assert not policy.lent(now_lent=False, missing_groups=9, groups_per_s=1.0)  # 9 s < 10 s
    assert not policy.lent(now_lent=True, missing_groups=2.5, groups_per_s=1.0)


def test_lent_workers_that_are_all_the_rollout_stay_lent_until_the_batch_is_ready():
    """A colocated layout whose every worker trains: nobody else completes the batch, so the
    gates do not apply: lent while a group is missing, however near the batch or costly the
    switch, and reclaimed once it is ready. Beside a rollout worker the gates hold as before."""
    policy = LendingPolicy(gain=2.0, assumed_cost_s=1.0)
    alone = Assignment(train=["t"], lendable=["t"])
    beside = Assignment(train=["t"], rollout=["r"], lendable=["t"])

    def role(assignment: Assignment, lent: set[str], missing: float, rate: float) -> Role:
        desired = trainer_roles(assignment, policy, lent, missing_groups=missing, groups_per_s=rate)
        return desired["t"][0]

    # 1.5 s to the batch < 2 x 1 s: beside a rollout worker not worth a lend; alone, lent.
    assert role(beside, set(), 1.5, 1.0) is Role.TRAIN
    assert role(alone, set(), 1.5, 1.0) is Role.ROLLOUT
    # The batch 0.4 s away: beside, reclaimed ahead of it; alone, kept to complete it.
    assert role(beside, {"t"}, 0.4, 1.0) is Role.TRAIN
    assert role(alone, {"t"}, 0.4, 1.0) is Role.ROLLOUT
    # Ready: both train.
    assert role(beside, {"t"}, 0, 5.0) is Role.TRAIN
    assert role(alone, {"t"}, 0, 5.0) is Role.TRAIN
    # Not lendable: trains, alone or not.
    assert role(Assignment(train=["t"]), set(), 4, 0.0) is Role.TRAIN


def test_a_trainer_computing_ahead_is_lent_only_where_nobody_else_generates():
    """``trainer.overlap``: the trainer computes each group as it completes, so while other
    workers generate, its worker is not lent however far off the batch (one lent before is
    reclaimed); where its workers are all the rollout, they are lent as before."""
    policy = LendingPolicy(gain=2.0, assumed_cost_s=1.0)
    alone = Assignment(train=["t"], lendable=["t"])
    beside = Assignment(train=["t"], rollout=["r"], lendable=["t"])

    def role(assignment: Assignment, lent: set[str], computes_ahead: bool) -> Role:
        desired = trainer_roles(
            assignment,
            policy,
            lent,
            missing_groups=8,  # 16 s off at 0.5 groups/s: far over a switch there and back
            groups_per_s=0.5,
            computes_ahead=computes_ahead,
        )
        return desired["t"][0]

    assert role(beside, set(), computes_ahead=False) is Role.ROLLOUT
    assert role(beside, set(), computes_ahead=True) is Role.TRAIN
    assert role(beside, {"t"}, computes_ahead=True) is Role.TRAIN
    assert role(alone, set(), computes_ahead=True) is Role.ROLLOUT
    assert role(alone, {"t"}, computes_ahead=True) is Role.ROLLOUT


def test_rate_meter_follows_a_steady_count():
    meter = RateMeter(window_s=1.0)
    for second in range(20):
        rate = meter.update(float(second), 3.0 * second)
    assert rate == pytest.approx(3.0, rel=0.01)
    assert meter.update(20.0, 57.0) < 3.0  # a count that stops growing lowers the rate


def test_admission_limit_refuses_a_pace_past_the_staleness_bound():
    assert admission_limit(steps_ahead=2, groups_per_step=4, max_staleness=1) == 8
    with pytest.raises(AdmissionError, match=r"steps_ahead=3 exceeds trainer.max_staleness \+ 1"):
        admission_limit(steps_ahead=3, groups_per_step=4, max_staleness=1)


def consumer(unacked: int, delivered: int) -> ConsumerInfo:
    seq = SequenceInfo(consumer_seq=delivered, stream_seq=delivered)
    config = ConsumerConfig()
    return ConsumerInfo("c", "s", config, None, seq, num_pending=0, num_ack_pending=unacked)


def test_samples_held_only_for_their_checkpoint_are_not_outstanding():
    """Two groups of 8 samples taken by the trainer's last step and held unacked while its
    checkpoint is written: outstanding and 'a batch is ready' without the trainer's count (the
    lend of a colocated trainer waited the whole write so), settled with it."""
    agents, trajectory, trainer = consumer(0, 0), consumer(0, 16), consumer(16, 16)
    held = admission_state(agents, trajectory, trainer, limit=8, group_size=8)
    assert (held.unsettled_groups, held.missing_groups(2), held.room) == (2, 0, 6)
    trained = admission_state(agents, trajectory, trainer, limit=8, group_size=8, trained=16)
    assert (trained.unsettled_groups, trained.missing_groups(2), trained.room) == (0, 2, 8)
    half = admission_state(agents, trajectory, trainer, limit=8, group_size=8, trained=8)
    assert half.unsettled_groups == 1


def test_tasks_the_trainer_waits_for_are_missing_however_many_groups_are_complete():
    """A batch's worth of groups at the trainer, whose step waits for an earlier admitted task
    (its entry's ``order_waiting``): 'a batch is ready' without the count, so a colocated
    trainer's worker was kept in ``train`` and nothing generated the task until the wait ran out;
    one group missing with it, so the worker is lent for it."""
    agents, trajectory, trainer = consumer(0, 0), consumer(0, 16), consumer(16, 16)
    ready = admission_state(agents, trajectory, trainer, limit=8, group_size=8)
    assert ready.missing_groups(2) == 0
    waiting = admission_state(agents, trajectory, trainer, limit=8, group_size=8, awaited=1)
    assert waiting.missing_groups(2) == 1 and waiting.outstanding == ready.outstanding


# -- admission on a real broker ----------------------------------------------------------------


def task(task_id: str, group_size: int = 1) -> TaskSubmitted:
    return TaskSubmitted(
        task_id=task_id,
        messages=[ChatMessage(role="user", content="1+1")],
        group_size=group_size,
    )


def sample(i: int) -> SampleReady:
    return SampleReady(
        sample_id=f"s{i}",
        session_id=f"s{i}",
        group_id=f"g{i}",
        token_ids=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        versions=[-1, 0],
        reward=1.0,
        on_policy=True,
    )


async def admission_counts(js, names: RunNames) -> tuple[int, int]:
    """(Tasks admitted and not finished, tasks waiting for the scheduler.)"""
    admitted = await js.consumer_info(names.tasks_stream, Durable.AGENTS)
    waiting = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
    return admitted.num_pending + admitted.num_ack_pending, waiting.num_pending


async def settles(js, names: RunNames, want: tuple[int, int]) -> None:
    """``admission_counts`` reach ``want`` and stay there: nothing more is admitted."""

    async def there() -> bool:
        return await admission_counts(js, names) == want

    await eventually(there)
    await asyncio.sleep(1.0)
    assert await admission_counts(js, names) == want


async def test_admission_paces_an_outside_clients_tasks_by_outstanding_groups(js, names):
    """10 tasks from a client; limit 3 outstanding groups. Finished tasks whose samples the
    trainer has not settled still count; settling them admits more, never past the limit."""
    agents = await js.pull_subscribe_bind(durable=Durable.AGENTS, stream=names.tasks_stream)
    trainer = await js.pull_subscribe_bind(durable=Durable.TRAINER, stream=names.samples_stream)

    async with admitting(js, names, limit=3):
        await submit_tasks(js, names, [task(f"t{i}") for i in range(10)], progress=False)
        await settles(js, names, (3, 6))  # 3 admitted; 6 wait (one is held by the scheduler)
        # An agent runner finishes 2 tasks: their 2 samples wait for the trainer.
        for msg in await agents.fetch(2, timeout=5):
            await msg.ack()
        for i in range(2):
            await js.publish(names.samples, codec.encode(sample(i)))
        await settles(js, names, (1, 6))  # 1 admitted + 2 unsettled groups = 3: nothing more
        # The trainer settles them: two more are admitted.
        for msg in await trainer.fetch(2, timeout=5):
            await msg.ack()
        await settles(js, names, (3, 4))
    admitted = [codec.decode(TaskSubmitted, m.data) for m in await agents.fetch(3, timeout=5)]
    assert [t.task_id for t in admitted] == ["t2", "t3", "t4"]  # in order, once each
    assert REGISTRY.get_sample_value("sf_scheduler_admission_limit") == 3


async def test_admission_counts_unbuilt_sessions_and_a_sessions_real_samples(js, names):
    """Limit 3, tasks of 2 attempts whose sessions fork into 3 samples each. A finished task's
    sessions count as its group before the trajectory manager builds them, and its 6 samples
    as one group after (3 samples per session, as the manager made them), not as 3."""
    agents = await js.pull_subscribe_bind(durable=Durable.AGENTS, stream=names.tasks_stream)
    trainer = await js.pull_subscribe_bind(durable=Durable.TRAINER, stream=names.samples_stream)

    async def finish_one() -> None:
        """As an agent runner: 2 sessions, each forked into 3 calls, ended; then the ack."""
        (msg,) = await agents.fetch(1, timeout=5)
        done = codec.decode(TaskSubmitted, msg.data)
        for attempt in range(2):
            sid = f"{done.task_id}-{attempt}"
            for leaf in range(3):
                await publish_call(js, names, record(sid, f"{sid}-{leaf}", [1, 2], [3 + leaf]))
            group = {"task_id": done.task_id, "group_id": done.task_id, "group_size": 2}
            end = SessionEnded(session_id=sid, reward=1.0, **group)
            await js.publish(names.traj_end, codec.encode(end))
        await msg.ack()

    async with admitting(js, names, limit=3) as admission:
        await submit_tasks(js, names, [task(f"t{i}", 2) for i in range(6)], progress=False)
        await settles(js, names, (3, 2))
        await finish_one()  # its sessions wait for the trajectory manager: still its group
        await settles(js, names, (2, 2))
        assert (await admission.state()).unbuilt_groups == 1
        async with building(js, names) as manager:
            await eventually(
                lambda: consumer_settled(js, names.traj_stream, Durable.TRAJECTORY),
                watch=manager,
            )
            await settles(js, names, (2, 2))  # 6 samples: one group
            await finish_one()
            await eventually(
                lambda: consumer_settled(js, names.traj_stream, Durable.TRAJECTORY),
                watch=manager,
            )
            await settles(js, names, (1, 2))  # 12 samples: two groups
            state = await admission.state()
            assert (state.unbuilt_groups, state.unsettled_groups) == (0, 2)
        # The trainer settles the first group's 6 samples: one more task is admitted.
        for msg in await trainer.fetch(6, timeout=5):
            await msg.ack()
        await settles(js, names, (2, 1))


async def test_a_scheduler_that_took_over_counts_by_the_waiting_tasks_group_size(js, names):
    """A fresh admission (a standby that took over) has admitted nothing yet: the 8 samples the
    trainer holds count at the group size of the task it is admitting (4: two groups, room for
    one more under a limit of 3), not at one sample per group (8 groups: no room, ever)."""
    for i in range(8):
        await js.publish(names.samples, codec.encode(sample(i)))
    async with admitting(js, names, limit=3):
        await submit_tasks(js, names, [task("t0", 4)], progress=False)
        await settles(js, names, (1, 0))


async def test_a_deposed_schedulers_admission_hands_its_task_back_once_and_stops(js, names):
    """Scheduler a claims the run's state, then b does (a successor): a's next stamp finds it
    deposed. a hands the task in hand back once and stops admitting (``LeaseLostError``). It
    used to fetch on and refuse every task until each had spent its ``max_deliver`` (5)
    deliveries and the broker gave it up: both tasks lost within the 10 s. b then admits
    every task, in order, from ticket 1."""
    stores = {}
    for leader in ("a", "b"):
        stores[leader] = await StateStore.open(js, names, leader)
        await stores[leader].claim()

    def stamper(leader: str) -> Stamper:
        return Stamper(stores[leader], dict, asyncio.Event(), wave_wait_s=0.0)

    await submit_tasks(js, names, [task("t0"), task("t1")], progress=False)
    deposed = Admission(js, names, SMALL_RUN.tasks, limit=8)
    with pytest.raises(LeaseLostError):
        await asyncio.wait_for(deposed.run(asyncio.Event(), stamper("a")), 10)
    waiting = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
    assert waiting.delivered.stream_seq == 1  # t0 was taken, once; t1 was not
    assert (waiting.num_redelivered, waiting.num_pending) == (0, 1)
    assert (await admission_counts(js, names))[0] == 0  # nothing admitted

    leader = Admission(js, names, SMALL_RUN.tasks, limit=8)
    async with serving(functools.partial(leader.run, stamp=stamper("b"))):
        await settles(js, names, (2, 0))
    done = await stream_messages(js, names.tasks_stream, TaskSubmitted, names.tasks_admitted)
    assert [(t.task_id, t.admitted.ticket) for t in done if t.admitted] == [("t0", 1), ("t1", 2)]


# -- role changes on real workers --------------------------------------------------------------


async def ask(nc, names: RunNames, wid: str, role: Role, epoch: int) -> RoleChangeAcked:
    """A role change as a scheduler sends it (its expiry: the worker runs on this machine's
    clock)."""
    request = RoleChangeRequested(
        worker_id=wid, role=role, epoch=epoch, reason="test", expires_at=time.time() + 30
    )
    reply = await nc.request(names.ctl_role(wid), codec.encode(request), timeout=30)
    return codec.decode(RoleChangeAcked, reply.data)


async def entry(js, names: RunNames, wid: str) -> WorkerRegistered:
    bucket = await js.key_value(names.workers_kv)
    return codec.decode(WorkerRegistered, (await bucket.get(wid)).value)


async def test_membership_takes_the_role_serves_requests_and_leaves_in_order(nc, js, names):
    """In: the entry's role taken, the entry written, role requests served, heartbeats. Out,
    here by an error in the body: heartbeats stopped, requests no longer served, the entry
    deleted (and not written again by a late heartbeat)."""
    taken: list[Role] = []

    async def switch(role: Role) -> None:
        taken.append(role)

    registration = await Registration.open(js, names, "m1", tags=["rollout"], role=Role.IDLE)
    with pytest.raises(RuntimeError, match="the body failed"):
        async with membership(nc, names, registration, switch, heartbeat_s=0.1) as roles:
            assert taken == [Role.IDLE]
            first = await registered(js, names, "m1")
            assert (first.role, first.epoch) == (Role.IDLE, 0)
            assert (await ask(nc, names, "m1", Role.ROLLOUT, 1)).ok
            assert taken == [Role.IDLE, Role.ROLLOUT] and roles.role is Role.ROLLOUT

            async def renewed() -> bool:
                entry = await registered(js, names, "m1")
                return entry.heartbeat_at > first.heartbeat_at and entry.role is Role.ROLLOUT

            await eventually(renewed)
            raise RuntimeError("the body failed")
    await asyncio.sleep(0.3)  # three heartbeat periods
    assert await registered(js, names, "m1") is None
    with pytest.raises(NoRespondersError):
        await nc.request(names.ctl_role("m1"), b"", timeout=5)


async def test_a_role_change_sent_as_the_entry_appears_is_answered(nc, js, names):
    """A scheduler asks for a role change as soon as it sees a worker's entry: the worker
    serves requests before it writes the entry, so the first request finds it listening. (It
    subscribed after the write: the request found no responder, and the scheduler fenced the
    worker on its first lend.)"""

    async def switch(role: Role) -> None:
        pass

    bucket = await js.key_value(names.workers_kv)
    watcher = await bucket.watch("m3")
    registration = await Registration.open(js, names, "m3", tags=["rollout"], role=Role.IDLE)
    left = asyncio.Event()

    async def member() -> None:
        async with membership(nc, names, registration, switch, heartbeat_s=0.1):
            await left.wait()

    task = asyncio.create_task(member())
    try:
        while (found := await watcher.updates(timeout=10)) is None or not found.value:
            pass
        ack = await ask(nc, names, "m3", Role.ROLLOUT, 1)  # at once, as the scheduler's tick
        assert (ack.ok, ack.role, ack.epoch) == (True, Role.ROLLOUT, 1)
    finally:
        left.set()
        await task
        await watcher.stop()


@pytest.mark.newest_nats  # starts worker processes: slow, and not about the server
async def test_a_worker_changes_role_by_epoch_and_refuses_stale_ones(
    broker, nc, js, names, tiny_model_dir
):
    w = worker_process(broker.url, names.run, tiny_model_dir, "w1").wait_ready()
    try:
        assert (await entry(js, names, "w1")).role is Role.ROLLOUT
        ack = await ask(nc, names, "w1", Role.IDLE, 5)
        assert (ack.ok, ack.role, ack.epoch) == (True, Role.IDLE, 5)
        e = await entry(js, names, "w1")
        assert (e.role, e.epoch) == (Role.IDLE, 5)
        assert await metric(w.metrics_url, "sf_worker_role", role="idle") == 1
        command = ["status", "--nats", broker.url, "--run", names.run]
        status = subprocess.run(
            [sys.executable, "-m", "seamlessflow.cli", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
        row = next(line.split() for line in status.stdout.splitlines() if line.startswith("w1 "))
        tags = f"rollout,node={e.host}"  # its node's tag added to the config's
        assert row[:7] == ["w1", e.host, tags, "idle", "5", "0", "no"], status.stdout
        assert row[-1] == "ok"  # its clock agrees with the server's
        info = {"node": e.host, "worker_id": "w1", "tags": tags}
        assert await metric(w.metrics_url, "sf_worker_info", **info) == 1
        assert "scheduler: none holds the lease" in status.stdout
        stale = await ask(nc, names, "w1", Role.ROLLOUT, 5)
        assert (stale.ok, stale.role, stale.epoch) == (False, Role.IDLE, 5)
        assert "stale epoch 5" in stale.error
        refused = await ask(nc, names, "w1", Role.TRAIN, 6)  # a rollout worker cannot train
        assert not refused.ok and "cannot hold the role 'train'" in refused.error
        assert (await ask(nc, names, "w1", Role.ROLLOUT, 7)).ok
        assert (await entry(js, names, "w1")).role is Role.ROLLOUT
        assert await metric(w.metrics_url, "sf_worker_role_changes_total", outcome="stale") == 1
    finally:
        w.stop()


@pytest.mark.newest_nats  # starts worker processes: slow, and not about the server
async def test_role_changes_under_load_lose_and_duplicate_no_generation(
    broker, nc, js, names, tiny_model_dir, openai_client
):
    """Two workers, 12 greedy calls; one worker is moved idle and back every 0.3 s. Every call
    ends with all its tokens, each the same as an uninterrupted call's. The calls start on w1
    alone (w2 idle until then), so that the first move finds w1 generating them."""
    workers = [worker_process(broker.url, names.run, tiny_model_dir, f"w{i}") for i in (1, 2)]
    flips = 0
    try:
        await asyncio.gather(*(asyncio.to_thread(w.wait_ready) for w in workers))
        assert (await ask(nc, names, "w2", Role.IDLE, 1)).ok
        async with Gateway(gateway_config(tiny_model_dir, names.run), broker.url) as gw:
            client = openai_client(gw.url)

            async def call(i: int):
                return await client.completions.create(
                    model=MODEL, prompt=f"count {i}:", max_tokens=120, temperature=0
                )

            calls = asyncio.gather(*(call(i) for i in range(12)))

            async def w1_generating() -> bool:
                return await metric(workers[0].metrics_url, "sf_rollout_requests_running") > 0

            await eventually(w1_generating)
            assert (await ask(nc, names, "w2", Role.ROLLOUT, 2)).ok
            epoch = 0
            while not calls.done():
                epoch += 1
                role = Role.IDLE if epoch % 2 else Role.ROLLOUT
                assert (await ask(nc, names, "w1", role, epoch)).ok
                flips += 1
                await asyncio.sleep(0.3)
            replies = await calls
            assert (await ask(nc, names, "w1", Role.ROLLOUT, epoch + 1)).ok
            again = [await call(i) for i in range(12)]  # the same calls, undisturbed
        reclaimed = await metric(
            workers[0].metrics_url, "sf_rollout_interruptions_total", cause="reclaimed"
        )
    finally:
        for w in workers:
            w.stop()
    assert flips >= 2 and reclaimed >= 1
    for reply, same in zip(replies, again, strict=True):
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 120
        assert reply.choices[0].text == same.choices[0].text


def scheduler(
    nc,
    names: RunNames,
    spec: PlacementSpec,
    configured: TrainerShape | None = None,
    *,
    poll_s: float = 0.25,
    **fields,
) -> Scheduler:
    """A scheduler of ``SchedulerConfig(**fields)``; ``poll_s``: its admission's poll."""
    from tagsched.admission import Admission

    return Scheduler(
        nc,
        names,
        SchedulerConfig(**fields),
        spec,
        Admission(nc.jetstream(), names, SMALL_RUN.tasks, poll_s=poll_s),
        workers_ttl_s=SMALL_RUN.workers_ttl_s,
        lease_s=SMALL_RUN.scheduler_lease_s,
        configured=configured,
    )


def fenced() -> float:
    return REGISTRY.get_sample_value("sf_scheduler_fenced_total") or 0.0


@pytest.mark.newest_nats  # starts worker processes: slow, and not about the server
async def test_a_worker_frozen_mid_work_is_fenced_its_call_continues_and_it_is_readmitted(
    broker, nc, js, names, tiny_model_dir, openai_client
):
    """w1 (node=a) and w2 (node=b) serve; the one running a greedy 300-token call is frozen
    (SIGSTOP), then the scheduler starts with a spec that wants only the other node serving. The
    frozen worker cannot ack: it is fenced and left out; the call continues on the other worker,
    token-exact. Killed and started again, it is a new registration and is re-admitted."""
    workers = {
        node: worker_process(
            broker.url, names.run, tiny_model_dir, f"w-{node}", "--tags", f"rollout,node={node}"
        )
        for node in ("a", "b")
    }
    restarted, running, stop = None, None, asyncio.Event()
    try:
        await asyncio.gather(*(asyncio.to_thread(w.wait_ready) for w in workers.values()))
        config = gateway_config(tiny_model_dir, names.run, stall_timeout_s=2)
        async with Gateway(config, broker.url) as gw:
            client = openai_client(gw.url)
            stream = await client.completions.create(
                model=MODEL, prompt="once upon a time", max_tokens=300, temperature=0, stream=True
            )
            text, frozen = "", None
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                if frozen is None and len(text) > 10:
                    for node, w in workers.items():
                        if await metric(w.metrics_url, "sf_rollout_requests_running") == 1:
                            frozen, other = node, "b" if node == "a" else "a"
                            w.proc.send_signal(signal.SIGSTOP)
                            spec = PlacementSpec(
                                train=Demand(tags=["train"], count=0),
                                rollout=Demand(tags=["rollout", f"node={other}"]),
                            )
                            # 3 s: the serving worker, generating on a loaded machine (two
                            # test workers on 2 cores), once took over 1 s to ack and was fenced
                            s = scheduler(nc, names, spec, role_change_deadline_s=3.0, tick_s=0.1)
                            before = fenced()
                            running = asyncio.create_task(s.run(stop))
                            break
            again = await client.completions.create(
                model=MODEL, prompt="once upon a time", max_tokens=300, temperature=0
            )
        assert frozen is not None, "no worker reported the call running"
        await eventually(lambda: fenced() == before + 1)
        assert f"w-{frozen}" not in s.live() and f"w-{other}" in s.live()
        assert text == again.choices[0].text  # the agent cannot tell
        # Killed and started again: a new registration, re-admitted and made idle.
        workers[frozen].proc.kill()
        workers[frozen].proc.wait()
        restarted = worker_process(
            broker.url, names.run, tiny_model_dir, f"w-{frozen}", "--tags", f"rollout,node={frozen}"
        ).wait_ready()

        async def idle_again() -> bool:
            e = await entry(js, names, f"w-{frozen}")
            return e.role is Role.IDLE and f"w-{frozen}" in s.live()

        await eventually(idle_again, timeout=30)
        assert not running.done()
    finally:
        stop.set()
        if running is not None:
            await asyncio.wait_for(running, 30)
        for w in [*workers.values(), restarted]:
            if w is not None:
                w.proc.send_signal(signal.SIGCONT)
                w.stop()


# -- admission by the registered trainer's shape -------------------------------------------------

TRAIN_ONLY = PlacementSpec(train=Demand(tags=["train"]), rollout=Demand(tags=["rollout"], count=0))


async def trainer_entry(js, names: RunNames, shape: TrainerShape) -> Registration:
    """A trainer's registry entry, as ``seamlessflow trainer`` writes it."""
    registration = await Registration.open(
        js, names, "trainer-1", tags=["train"], role=Role.TRAIN, trainer=shape
    )
    await registration.put()
    return registration


async def admitted(js, names: RunNames) -> int:
    info = await js.consumer_info(names.tasks_stream, Durable.AGENTS)
    return info.num_pending + info.num_ack_pending


async def stays_admitted(js, names: RunNames, n: int, watch: asyncio.Task) -> None:
    """``n`` tasks reach the agents, and no more after a while."""
    await eventually(lambda: _eq(admitted(js, names), n), watch=watch)
    await asyncio.sleep(1.0)
    assert await admitted(js, names) == n


async def _eq(value, want) -> bool:
    return await value == want


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("sf_scheduler_admission_refused_total", {"reason": reason})


async def test_admission_follows_the_registered_trainers_shape(nc, js, names):
    """Nothing is admitted until a trainer registers; then steps_ahead (2) times the trainer's
    groups_per_step, as its entry says and as it changes; a shape past the staleness bound
    (steps_ahead > max_staleness + 1) is refused and admits nothing more."""
    s = scheduler(nc, names, TRAIN_ONLY, steps_ahead=2, tick_s=0.1)
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    stale0 = refused("staleness")
    try:
        await submit_tasks(js, names, [task(f"t{i}") for i in range(12)], progress=False)
        await stays_admitted(js, names, 0, running)
        trainer = await trainer_entry(js, names, TrainerShape(groups_per_step=2, max_staleness=1))
        await stays_admitted(js, names, 4, running)
        assert REGISTRY.get_sample_value("sf_scheduler_admission_limit") == 4
        await trainer.put(trainer=TrainerShape(groups_per_step=3, max_staleness=1))
        await stays_admitted(js, names, 6, running)
        await trainer.put(trainer=TrainerShape(groups_per_step=4, max_staleness=0))
        await eventually(lambda: refused("staleness") == stale0 + 1, watch=running)
        await stays_admitted(js, names, 6, running)
        assert REGISTRY.get_sample_value("sf_scheduler_admission_limit") == 0
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_steps_end_admits_the_waiting_task_at_once_not_at_the_next_poll(nc, js, names):
    """Limit 1 (steps_ahead 1, a group a step). The trainer holds the one finished group's sample
    unacked: a submitted task waits for room. Then the trainer's entry says that sample is trained
    (``trained_unacked``: its step ended, the sample is held only for its checkpoint): the task is
    admitted at once, though admission's poll is an hour. It waited for the poll before, and a
    lent worker with an empty queue waited with it."""
    s = scheduler(nc, names, TRAIN_ONLY, steps_ahead=1, tick_s=0.1, poll_s=3600.0)
    held = await js.pull_subscribe_bind(durable=Durable.TRAINER, stream=names.samples_stream)
    await js.publish(names.samples, codec.encode(sample(0)))
    (msg,) = await held.fetch(1, timeout=5)  # the trainer's, unacked
    trainer = await trainer_entry(js, names, TrainerShape(groups_per_step=1, max_staleness=1))
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    try:
        await submit_tasks(js, names, [task("a")], progress=False)
        await stays_admitted(js, names, 0, running)
        await trainer.put(trained_unacked=1)
        await eventually(lambda: _eq(admitted(js, names), 1), timeout=5, watch=running)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    await msg.ack()


async def test_tasks_wait_out_a_weight_load_and_carry_rising_tickets_at_the_served_version(
    nc, js, names
):
    """Admission stamps each task with the next ticket and the oldest version a rollout worker
    serves. A worker loading a new version: a task with room waits for the load, then carries
    the new version; a load that outlasts ``wave_wait_s`` holds a task that long, no longer,
    and its stamp is the version still served (a lower bound: no token will be older). Each
    stamp says from which ticket on its version was stamped."""
    spec = PlacementSpec(train=Demand(tags=["train"]), rollout=Demand(tags=["rollout"]))
    s = scheduler(nc, names, spec, steps_ahead=2, tick_s=0.1, wave_wait_s=2.0)
    await trainer_entry(js, names, TrainerShape(groups_per_step=2, max_staleness=1))
    worker = await Registration.open(js, names, "w-1", tags=["rollout"], role=Role.ROLLOUT)
    await worker.put(version=2, weights=WeightsState.LOADING)
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    try:
        await submit_tasks(js, names, [task("a")], progress=False)
        await stays_admitted(js, names, 0, running)  # held: the worker is loading
        await worker.put(version=3, weights=WeightsState.READY)
        await stays_admitted(js, names, 1, running)
        await worker.put(weights=WeightsState.WAITING)  # version 4 waits for its wave
        submitted = time.monotonic()
        await submit_tasks(js, names, [task("b")], progress=False)
        await eventually(lambda: _eq(admitted(js, names), 2), watch=running)
        held = time.monotonic() - submitted
        await worker.put(version=4, weights=WeightsState.READY)
        await submit_tasks(js, names, [task("c"), task("d")], progress=False)
        await eventually(lambda: _eq(admitted(js, names), 4), watch=running)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    done = await stream_messages(js, names.tasks_stream, TaskSubmitted, names.tasks_admitted)
    stamps = [
        (t.task_id, t.admitted.ticket, t.admitted.version, t.admitted.since)
        for t in done
        if t.admitted
    ]
    # since: the first ticket stamped at the stamp's version (the trainer's ``trainer.order``)
    assert stamps == [("a", 1, 3, 1), ("b", 2, 3, 1), ("c", 3, 4, 3), ("d", 4, 4, 3)]
    assert 2.0 <= held < 5.0


async def test_a_trainer_disagreeing_with_the_schedulers_config_is_refused(nc, js, names, caplog):
    """The scheduler's config says groups_per_step 2; the trainer registers 3: an ERROR naming
    both, counted, and nothing admitted. Once the trainer registers the same, admission runs."""
    configured = TrainerShape(groups_per_step=2, max_staleness=1)
    s = scheduler(nc, names, TRAIN_ONLY, configured, steps_ahead=2, tick_s=0.1)
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    mismatch0 = refused("mismatch")
    try:
        await submit_tasks(js, names, [task(f"t{i}") for i in range(6)], progress=False)
        trainer = await trainer_entry(js, names, TrainerShape(groups_per_step=3, max_staleness=1))
        await eventually(lambda: refused("mismatch") == mismatch0 + 1, watch=running)
        await trainer.put()  # a heartbeat: the same shape again
        await stays_admitted(js, names, 0, running)
        assert refused("mismatch") == mismatch0 + 1  # once per shape, not per heartbeat
        # (the scheduler's own: asyncio may log a client another test left to the collector)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        (line,) = [r.getMessage() for r in errors if r.name.startswith("tagsched")]
        assert line.startswith("admission_refused reason=mismatch")
        assert "trainer trainer-1 runs groups_per_step=3 max_staleness=1" in line
        assert "this scheduler's config has groups_per_step=2 max_staleness=1" in line
        await trainer.put(trainer=configured)
        await stays_admitted(js, names, 4, running)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_scheduler_places_roles_by_the_users_tags(nc, js, names, caplog):
    """Four workers tagged apart (two H200 and two L4 by their gpu= tags, three of them able to
    train) and a layout asking for the trainer on two H200 workers and rollout on the rest: the
    H200s train, the L4s serve. One H200 leaves: the spec cannot be met, and the scheduler says
    which tags the others lack (it fails after placement_timeout_s with that message)."""
    fleet_tags = {
        "h200-a": "train,rollout,gpu=h200",
        "h200-b": "train,rollout,gpu=h200",
        "l4-a": "train,rollout,gpu=l4",  # able to train, but not on an H200
        "l4-b": "rollout,gpu=l4",
    }
    spec = layout(train={"tags": ["gpu=h200"], "count": 2}, rollout={"count": "rest"})
    roles: dict[str, list[Role]] = {wid: [] for wid in fleet_tags}

    def switch(wid: str):
        async def take(role: Role) -> None:
            roles[wid].append(role)

        return take

    def problems() -> list[str]:
        return [r.getMessage() for r in caplog.records if "placement_unsatisfied" in r.getMessage()]

    s = scheduler(nc, names, spec, tick_s=0.1)
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    caplog.set_level(logging.WARNING, logger="tagsched")
    try:
        async with contextlib.AsyncExitStack() as staying, contextlib.AsyncExitStack() as leaving:
            for wid, tags in fleet_tags.items():
                registration = await Registration.open(
                    js, names, wid, tags=tags.split(","), role=Role.IDLE
                )
                member = membership(nc, names, registration, switch(wid), heartbeat_s=0.2)
                await (leaving if wid == "h200-b" else staying).enter_async_context(member)
            want = {
                "h200-a": Role.TRAIN,
                "h200-b": Role.TRAIN,
                "l4-a": Role.ROLLOUT,
                "l4-b": Role.ROLLOUT,
            }
            await eventually(
                lambda: (
                    {wid: taken[-1:] for wid, taken in roles.items()}
                    == {wid: [role] for wid, role in want.items()}
                ),
                watch=running,
            )
            for wid, role in want.items():  # the registry says so too
                assert (await registered(js, names, wid)).role is role
            assert (s.assignment.train, s.assignment.rollout) == (
                ["h200-a", "h200-b"],
                ["l4-a", "l4-b"],
            )
            await leaving.aclose()  # h200-b leaves: one H200 is not enough
            wanted = "train needs 2 worker(s) tagged {train,gpu=h200}; 1 of the live workers are"
            # (under load a heartbeat may lapse for a tick: a line may list fewer live workers)
            await eventually(
                lambda: any(wanted in p and "l4-a{" in p and "l4-b{" in p for p in problems()),
                watch=running,
            )
        problem = next(p for p in problems() if wanted in p and "l4-a{" in p and "l4-b{" in p)
        assert "l4-a{train,rollout,gpu=l4,node=" in problem
        assert "} lacks {gpu=h200}, l4-b{rollout,gpu=l4,node=" in problem
        assert problem.endswith('} lacks {train,gpu=h200}"')
        assert REGISTRY.get_sample_value("sf_scheduler_unsatisfied") == 1
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_scheduler_waits_for_the_registry_however_long_it_takes_and_then_leads(
    nc, js, names
):
    """The registry's bucket is gone when the scheduler starts leading (as when JetStream is
    still electing its leader after a node was lost): the scheduler keeps its lease and waits,
    well past the lease's length, and once the registry answers it places the workers. (It used
    to give up after one lease length: the process exited.)"""
    await js.delete_key_value(names.workers_kv)
    s = scheduler(nc, names, layout(train={"count": 1}, rollout={"count": "rest"}), tick_s=0.1)
    stop = asyncio.Event()
    running = asyncio.create_task(s.run(stop))
    roles: dict[str, list[Role]] = {"t": [], "r": []}

    def switch(wid: str):
        async def take(role: Role) -> None:
            roles[wid].append(role)

        return take

    try:
        await asyncio.sleep(3 * SMALL_RUN.scheduler_lease_s)
        assert not running.done(), running.exception()
        assert REGISTRY.get_sample_value("sf_scheduler_leader") == 1
        await provision_run(js, names.run, SMALL_RUN)  # the registry is back
        async with contextlib.AsyncExitStack() as members:
            for wid, tag in (("t", "train"), ("r", "rollout")):
                registration = await Registration.open(js, names, wid, tags=[tag], role=Role.IDLE)
                member = membership(nc, names, registration, switch(wid), heartbeat_s=0.2)
                await members.enter_async_context(member)
            want = {"t": [Role.TRAIN], "r": [Role.ROLLOUT]}
            await eventually(
                lambda: {wid: taken[-1:] for wid, taken in roles.items()} == want,
                watch=running,
                timeout=30,
            )
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_scheduler_started_while_the_broker_is_away_waits_for_it_and_leads(
    tmp_path, nats_binary
):
    """The broker goes away just as the scheduler starts (a restart): opening its lease and its
    state waits for the broker instead of failing the process, and once the broker is back the
    scheduler says it is ready and leads. (Those two lookups failed at the first timeout.)"""
    cfg = broker_config(tmp_path, nats_binary).model_copy(update={"port": free_port()})
    names = RunNames("sched-away")
    server = EmbeddedBroker(cfg)
    admin = own_run(server, names.run)
    server.start()
    stop, ready = asyncio.Event(), asyncio.Event()
    try:
        async with session(server.url, "test", identity_file=admin) as nc:
            await provision_run(nc.jetstream(), names.run, SMALL_RUN)
            server.stop()
            s = scheduler(nc, names, layout(train={"count": 1}), tick_s=0.1)
            running = asyncio.create_task(s.run(stop, on_ready=ready.set))
            await asyncio.sleep(8.0)  # past a JetStream request's timeout (5 s)
            assert not running.done(), running.exception()
            assert not ready.is_set()
            server = EmbeddedBroker(cfg).start()
            await eventually(ready.is_set, watch=running, timeout=30)
            await eventually(
                lambda: REGISTRY.get_sample_value("sf_scheduler_leader") == 1,
                watch=running,
                timeout=30,
            )
            stop.set()
            await asyncio.wait_for(running, 30)
    finally:
        stop.set()
        server.stop()


# -- the scheduler process ---------------------------------------------------------------------


def scheduler_config(tmp_path: Path, run: str, **scheduler: object) -> Path:
    lines = [f'run = "{run}"', "[provision]", "scheduler_lease_s = 2.0", "[scheduler]"]
    lines += [f"{k} = {v!r}" for k, v in scheduler.items()]
    path = tmp_path / f"sched-{uuid.uuid4().hex[:6]}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_unsatisfiable_spec_fails_the_scheduler_naming_the_missing_tags(
    broker, js, run_name, tmp_path
):
    provision = SMALL_RUN.model_copy(update={"scheduler_lease_s": 2.0})
    await provision_run(js, run_name, provision)
    config = scheduler_config(tmp_path, run_name, placement_timeout_s=1.0)
    proc = ServiceProcess("scheduler", "scheduler", "--nats", broker.url, "--config", str(config))
    code = await asyncio.to_thread(proc.proc.wait, 60)
    out = "".join(proc.output)
    assert code == 2
    assert "placement spec unsatisfiable for 1s: train needs 1 worker(s) tagged {train}" in out


async def test_a_standby_scheduler_takes_over_within_the_lease(broker, js, run_name, tmp_path):
    provision = SMALL_RUN.model_copy(update={"scheduler_lease_s": 2.0})
    await provision_run(js, run_name, provision)
    config = scheduler_config(tmp_path, run_name, placement_timeout_s=600.0)

    def start(name: str) -> ServiceProcess:
        return ServiceProcess(
            name, "scheduler", "--nats", broker.url, "--config", str(config), "--scheduler-id", name
        )

    first = start("first").wait_ready()
    second = None
    try:

        async def leads(p: ServiceProcess) -> bool:
            return await metric(p.metrics_url, "sf_scheduler_leader") == 1

        await eventually(lambda: leads(first))
        second = start("second").wait_ready()
        await asyncio.sleep(2.0)
        assert not await leads(second)  # one leader at a time
        first.proc.kill()  # no release: the lease must expire
        killed = time.monotonic()
        await eventually(lambda: leads(second), timeout=20)
        took = time.monotonic() - killed
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert took <= 2.0 + 2.0 / 3 + 2.0  # lease + retry period + the expiry sweep's slack


async def test_tasks_wait_for_a_scheduler_and_are_admitted_once_one_leads(
    broker, js, names, tmp_path
):
    """No scheduler: a client's tasks wait on sf.<run>.tasks; none reaches the agents."""
    await submit_tasks(js, names, [task("a"), task("b")], progress=False)
    await asyncio.sleep(0.5)
    agents = await js.consumer_info(names.tasks_stream, Durable.AGENTS)
    assert agents.num_pending == 0
    async with admitting(js, names):

        async def both() -> bool:
            info = await js.consumer_info(names.tasks_stream, Durable.AGENTS)
            return info.num_pending == 2

        await eventually(both)
    done = await stream_messages(js, names.tasks_stream, TaskSubmitted, names.tasks_admitted)
    assert sorted(t.task_id for t in done) == ["a", "b"]
