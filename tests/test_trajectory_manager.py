"""The trajectory manager on a real nats-server: call records and session ends in, samples out."""

import asyncio
import json
import signal

import pytest

from broker import codec
from broker.exceptions import RunNotProvisionedError
from broker.messages import (
    MessageRejected,
    SampleReady,
    SessionEnded,
)
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.subjects import Durable, RunNames
from common.metrics import serve_metrics
from common.rewards import RewardsConfig
from seamlessflow.config import load_config
from seamlessflow.exceptions import ConfigError
from seamlessflow.processes import ServiceProcess
from tests.support import (
    SMALL_RUN,
    building,
    consumer_settled,
    eventually,
    metric,
    publish_call,
    record,
    stream_messages,
)
from trajectory.config import TrajectoryConfig
from trajectory.manager import REGISTRY, TrajectoryManager

pytestmark = pytest.mark.newest_nats


async def end_session(js, names: RunNames, end: SessionEnded) -> None:
    await js.publish(names.traj_end, codec.encode(end), headers=codec.headers())


async def samples(js, names: RunNames) -> list[SampleReady]:
    return await stream_messages(js, names.samples_stream, SampleReady)


@pytest.fixture(scope="module")
def metrics_url():
    """This process's registry: the manager under test runs in it."""
    endpoint = serve_metrics(REGISTRY, INGRESS_METRICS)
    yield endpoint.url
    endpoint.close()


@pytest.fixture
async def manager(js, names: RunNames):
    async with building(js, names) as task:
        yield task


async def settled(js, names: RunNames) -> bool:
    """Every SessionEnded has been acked by the trajectory durable."""
    return await consumer_settled(js, names.traj_stream, Durable.TRAJECTORY)


async def test_sessions_become_samples_and_a_redelivered_end_adds_none(
    manager, js, names, metrics_url
):
    sampled = await metric(metrics_url, "sf_trajectory_sessions_total", outcome="sampled")
    duplicates = await metric(metrics_url, "sf_trajectory_samples_total", outcome="duplicate")
    loss = await metric(metrics_url, "sf_trajectory_tokens_total", kind="loss")
    # Session a: two turns, then the agent edits its second user turn (a fork).
    for call in (
        record("a", "a1", [1, 2, 3], [10, 11]),
        record("a", "a2", [1, 2, 3, 10, 11, 4], [12]),
        record("a", "a3", [1, 2, 3, 10, 11, 5, 6], [13, 14], version=1),
        record("b", "b1", [7, 8], [20, 21, 22]),
    ):
        await publish_call(js, names, call)
    await end_session(
        js, names, SessionEnded(session_id="a", reward=1.0, task_id="t", group_size=2)
    )
    await end_session(
        js, names, SessionEnded(session_id="b", reward=0.0, task_id="t", group_size=2)
    )

    await eventually(lambda: settled(js, names), watch=manager)
    got = sorted(await samples(js, names), key=lambda s: (s.session_id, s.token_ids))
    assert [(s.session_id, s.token_ids, s.loss_mask) for s in got] == [
        ("a", [1, 2, 3, 10, 11, 4, 12], [0, 0, 0, 1, 1, 0, 1]),
        ("a", [1, 2, 3, 10, 11, 5, 6, 13, 14], [0, 0, 0, 0, 0, 0, 0, 1, 1]),
        ("b", [7, 8, 20, 21, 22], [0, 0, 1, 1, 1]),
    ]
    assert [s.versions[-1] for s in got] == [0, 1, 0]
    assert [s.session_samples for s in got] == [2, 2, 1]
    assert {(s.group_id, s.group_size, s.reward) for s in got} == {("t", 2, 1.0), ("t", 2, 0.0)}
    assert await metric(metrics_url, "sf_trajectory_sessions_total", outcome="sampled") == (
        sampled + 2
    )
    assert await metric(metrics_url, "sf_trajectory_tokens_total", kind="loss") == loss + 8

    # Redelivery (or a repeated end): the same samples, de-duplicated by sample_id.
    await end_session(
        js, names, SessionEnded(session_id="a", reward=1.0, task_id="t", group_size=2)
    )

    async def deduplicated() -> bool:
        now = await metric(metrics_url, "sf_trajectory_samples_total", outcome="duplicate")
        return now == duplicates + 2

    await eventually(deduplicated, watch=manager)
    again = await samples(js, names)
    assert len(again) == 3 and {s.sample_id for s in again} == {s.sample_id for s in got}


async def test_bad_call_records_are_dead_lettered_and_the_session_still_built(
    manager, js, names, metrics_url
):
    invalid = await metric(metrics_url, "sf_trajectory_calls_total", outcome="invalid")
    await publish_call(js, names, record("s", "c1", [1, 2], [3]))
    subject = names.traj_calls("s")
    garbage = await js.publish(subject, b"\xc1 not msgpack", headers=codec.headers())
    # A valid record of another session, stored on this session's subject.
    stray = record("other", "c9", [5], [6])
    misplaced = await js.publish(subject, codec.encode(stray), headers=codec.headers())
    await publish_call(js, names, record("s", "c2", [1, 2, 3, 4], [5]))
    await end_session(js, names, SessionEnded(session_id="s", reward=0.5))

    await eventually(lambda: settled(js, names), watch=manager)
    (sample,) = await samples(js, names)
    assert sample.token_ids == [1, 2, 3, 4, 5] and sample.loss_mask == [0, 0, 1, 0, 1]
    assert sample.group_id == "s"  # no group or task: the session is its own group
    dead = await stream_messages(js, names.dead_stream, MessageRejected)
    assert [(d.source, d.subject, d.stream_seq) for d in dead] == [
        ("trajectory", subject, garbage.seq),
        ("trajectory", subject, misplaced.seq),
    ]
    assert "not valid msgpack" in dead[0].reason and dead[0].payload == b"\xc1 not msgpack"
    assert "names session 'other'" in dead[1].reason
    assert await metric(metrics_url, "sf_trajectory_calls_total", outcome="invalid") == (
        invalid + 2
    )


async def test_session_without_calls_is_counted_and_yields_nothing(manager, js, names, metrics_url):
    before = await metric(metrics_url, "sf_trajectory_sessions_total", outcome="no_calls")
    # Another session's calls are not this session's.
    await publish_call(js, names, record("busy", "c1", [1], [2]))
    await end_session(js, names, SessionEnded(session_id="idle", reward=0.0))
    await eventually(lambda: settled(js, names), watch=manager)
    assert await samples(js, names) == []
    after = await metric(metrics_url, "sf_trajectory_sessions_total", outcome="no_calls")
    assert after == before + 1


async def test_outside_clients_unusable_rewards_are_dead_lettered_never_trained_on(
    js, names, metrics_url
):
    """A client that drives the gateway itself publishes its SessionEnded as JSON: a reward
    outside the run's rewards.range (here [0, 1]), NaN or an infinity is dead-lettered with the
    reason and counted; the session gives no sample, and the manager goes on."""
    stop = asyncio.Event()
    manager = TrajectoryManager(
        js, names, SMALL_RUN.traj, TrajectoryConfig(), RewardsConfig(range=(0.0, 1.0))
    )
    running = asyncio.create_task(manager.run(stop))
    refused = await metric(metrics_url, "sf_trajectory_sessions_total", outcome="reward_refused")
    rewards = {"high": "2.5", "low": "-0.5", "nan": "NaN", "inf": "Infinity", "ok": "1.0"}
    for sid, reward in rewards.items():
        await publish_call(js, names, record(sid, f"{sid}-1", [1, 2], [3, 4]))
        body = f'{{"session_id": "{sid}", "reward": {reward}, "group_id": "g", "group_size": 5}}'
        await js.publish(names.traj_end, body.encode(), headers=codec.headers(codec.Encoding.JSON))
    try:
        await eventually(lambda: settled(js, names), watch=running)
        assert [s.session_id for s in await samples(js, names)] == ["ok"]
        dead = await stream_messages(js, names.dead_stream, MessageRejected)
        reasons = {json.loads(d.payload)["session_id"]: d.reason for d in dead}
        assert "reward 2.5, outside [0, 1] (rewards.range)" in reasons.pop("high")
        assert "reward -0.5, outside [0, 1] (rewards.range)" in reasons.pop("low")
        assert reasons == {  # refused by the schema, before the handler
            "nan": "invalid SessionEnded: reward: Input should be a finite number (got NaN)",
            "inf": "invalid SessionEnded: reward: Input should be a finite number (got Infinity)",
        }
        assert await metric(
            metrics_url, "sf_trajectory_sessions_total", outcome="reward_refused"
        ) == (refused + 2)
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)


async def test_cli_serves_until_sigterm(broker, js, names):
    proc = ServiceProcess(
        "trajectory", "trajectory", "--nats", broker.url, "--run", names.run, threads=None
    )
    try:
        proc.wait_ready(timeout=60)
        assert proc.handshake["run"] == names.run  # said on its pipe, not read off its output
        await publish_call(js, names, record("s", "c1", [1], [2, 3]))
        await end_session(js, names, SessionEnded(session_id="s", reward=1.0))
        await eventually(lambda: settled(js, names))
        (sample,) = await samples(js, names)
        assert sample.loss_mask == [0, 1, 1]
        assert await metric(proc.metrics_url, "sf_trajectory_samples_total", outcome="stored") == 1
    finally:
        assert proc.stop(signal.SIGTERM) == 0
    assert "trajectory stopped" in "".join(proc.output)


async def test_unprovisioned_run_is_a_clear_error(js):
    manager = TrajectoryManager(js, RunNames("nope"), SMALL_RUN.traj, TrajectoryConfig())
    with pytest.raises(RunNotProvisionedError, match="run 'nope' is not provisioned"):
        await manager.run(asyncio.Event())


def test_config_section_is_read_and_checked(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('run = "r"\n[trajectory]\nconcurrency = 3\n')
    assert load_config(toml).trajectory == TrajectoryConfig(concurrency=3)
    toml.write_text("[trajectory]\nconcurrency = 0\n")
    with pytest.raises(ConfigError, match=r"trajectory\.concurrency"):
        load_config(toml)
