"""Run provisioning: creates everything once, is a no-op when repeated, refuses conflicts."""

import pytest
from nats.js.errors import APIError

from broker.config import ConsumerLimits, ProvisionConfig
from broker.exceptions import BrokerError, ProvisionConflictError
from broker.provision import plan, provision_run, run_status
from broker.subjects import Durable, RunNames
from tests.support import SMALL_RUN


def test_plan_keeps_every_subject_inside_the_run_and_work_queues_unshared():
    p = plan("r1", ProvisionConfig())
    subjects = [s for sc in p.streams for s in sc.subjects]
    assert all(s.startswith("sf.r1.") for s in subjects)
    assert len(subjects) == len(set(subjects))
    assert {c.durable for c in p.consumers} == set(Durable)
    # Two runs never overlap.
    other = {s for sc in plan("r2", ProvisionConfig()).streams for s in sc.subjects}
    assert not other & set(subjects)


async def test_provisioning_twice_is_a_no_op(js, run_name):
    first = await provision_run(js, run_name, SMALL_RUN)
    before = {name: (await js.stream_info(name)).config for name in _streams(run_name)}
    second = await provision_run(js, run_name, SMALL_RUN)
    after = {name: (await js.stream_info(name)).config for name in _streams(run_name)}

    assert len(first.created) == 15  # 6 streams, 3 KV buckets, object store, 5 consumers
    assert second.created == []
    assert sorted(second.unchanged) == sorted(first.created)
    assert before == after
    for c in plan(run_name, SMALL_RUN).consumers:
        info = await js.consumer_info(c.stream, c.durable)
        assert info.config.ack_wait == pytest.approx(c.limits.ack_wait_s)


async def test_incompatible_config_fails_naming_each_difference(js, run_name):
    await provision_run(js, run_name, SMALL_RUN)
    changed = SMALL_RUN.model_copy(
        update={
            "workers_ttl_s": 99.0,
            "rollout": ConsumerLimits(ack_wait_s=5, max_deliver=2, max_ack_pending=7),
        }
    )
    with pytest.raises(ProvisionConflictError) as info:
        await provision_run(js, run_name, changed)
    text = str(info.value)
    n = RunNames(run_name)
    assert f"stream KV_{n.workers_kv}.max_age: exists as 30.0, config asks 99.0" in text
    assert f"consumer {n.gen_stream}/rollout.max_deliver: exists as 10, config asks 2" in text
    assert "use a new run name" in text
    # Nothing was changed by the refused attempt.
    info = await js.consumer_info(n.gen_stream, Durable.ROLLOUT)
    assert info.config.max_deliver == 10


async def test_storage_the_server_cannot_reserve_is_a_clear_error(js, run_name):
    huge = SMALL_RUN.model_copy(
        update={"samples": SMALL_RUN.samples.model_copy(update={"max_bytes": 1 << 50})}
    )
    with pytest.raises(BrokerError, match=r"creating SF_\w+_SAMPLES failed: .*storage"):
        await provision_run(js, run_name, huge)


async def test_a_full_work_queue_refuses_new_work_instead_of_dropping_old(js, names):
    big = b"x" * (900 << 10)
    refused = None
    for i in range(8):  # 8 x 900 KiB > the 4 MiB stream
        try:
            await js.publish(names.tasks, big + bytes([i]))
        except APIError as exc:
            refused = (i, exc)
            break
    assert refused is not None and "maximum bytes" in str(refused[1]).lower()
    state = (await js.stream_info(names.tasks_stream)).state
    assert state.first_seq == 1 and state.messages == refused[0]  # nothing already queued lost


async def test_status_reports_depths_and_missing_parts(js, names):
    await js.publish(names.tasks, b"x")
    await js.publish(names.tasks, b"y")
    status = await run_status(js, names.run)
    assert status.missing == []
    tasks = next(s for s in status.streams if s.name == names.tasks_stream)
    assert tasks.messages == 2
    assert {c.name: c.pending for c in tasks.consumers} == {"agents": 0, "scheduler": 2}
    assert (await run_status(js, "never-provisioned")).streams == []


def _streams(run: str) -> list[str]:
    p = plan(run, SMALL_RUN)
    return [s.name for s in p.streams] + list(p.bucket_streams)
