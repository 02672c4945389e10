"""CPU placement of ``seamlessflow run``: the split of the CPUs between trainer and rollout
workers (pure), its errors, and a real child process pinned where it is told."""

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from seamlessflow.config import CpusConfig, RolloutConfig, RunConfig
from seamlessflow.exceptions import PlacementError, ServiceProcessError
from seamlessflow.placement import CpuSet, place
from seamlessflow.processes import ServiceProcess
from trainer.config import TrainerConfig

EIGHT = set(range(8))


def layout(cpus: CpusConfig, workers: int = 1, ranks: int = 1, available=EIGHT):
    trainer = TrainerConfig(world_size=ranks, threads=1)
    return place(cpus, trainer, RolloutConfig(workers=workers, threads=1), available)


def test_the_automatic_split_gives_trainer_and_workers_disjoint_sets_and_fitting_threads():
    got = layout(CpusConfig(), workers=2, ranks=2)
    assert got.trainer == CpuSet(frozenset({0, 1, 2, 3}), 2)  # two ranks share four CPUs
    assert got.workers == [CpuSet(frozenset({4, 5}), 2), CpuSet(frozenset({6, 7}), 2)]
    two = layout(CpusConfig(), available={0, 1})  # this machine's shape
    assert two.trainer == CpuSet(frozenset({0}), 1) and two.workers == [CpuSet(frozenset({1}), 1)]
    one = layout(CpusConfig(), workers=2, available={3})  # nothing to split: all share it
    assert one.trainer == CpuSet(frozenset({3}), 1) and one.workers == [one.trainer] * 2
    # More workers than rollout CPUs: they take them in turn, never the trainer's.
    crowded = layout(CpusConfig(trainer_share=0.75), workers=3)
    assert [w.cpus for w in crowded.workers] == [{6}, {7}, {6}]
    assert not crowded.trainer.cpus & {6, 7}


def test_given_cpu_sets_are_used_and_none_means_no_affinity():
    got = layout(CpusConfig(trainer=[7, 6, 5], rollout=[0]), workers=1)
    assert got.trainer == CpuSet(frozenset({5, 6, 7}), 3)
    assert got.workers == [CpuSet(frozenset({0}), 1)]
    free = place(
        CpusConfig(placement="none"),
        TrainerConfig(threads=3),
        RolloutConfig(workers=2, threads=2),
        EIGHT,
    )
    assert free.trainer == CpuSet(None, 3) and free.workers == [CpuSet(None, 2)] * 2


def test_bad_cpu_sets_are_clear_errors():
    with pytest.raises(PlacementError, match=r"cpus.trainer names CPUs \[9, 12\].*0-7"):
        layout(CpusConfig(trainer=[1, 9, 12]))
    with pytest.raises(PlacementError, match="no CPU left for the rollout workers"):
        layout(CpusConfig(trainer=[0, 1]), available={0, 1})
    with pytest.raises(ValidationError, match=r"share CPUs \[2\]"):
        RunConfig.model_validate({"cpus": {"trainer": [1, 2], "rollout": [2, 3]}})
    with pytest.raises(ValidationError, match="distinct"):
        CpusConfig(rollout=[3, 3])


def _allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(
        line.split(":")[1].strip() for line in status.splitlines() if "allowed_list" in line
    )


def test_a_service_process_and_its_children_run_on_their_cpus_only(tmp_path):
    cpu = max(os.sched_getaffinity(0))
    state = str(tmp_path / "broker")
    broker = ServiceProcess(
        "broker", "broker", "--state-dir", state, threads=1, cpus=frozenset({cpu})
    )
    try:
        broker.wait_ready(60)
        pid = broker.proc.pid
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert children  # the nats-server it started
        for p in [pid, *map(int, children)]:
            assert _allowed(p) == str(cpu)
    finally:
        broker.stop()
    with pytest.raises(ServiceProcessError, match="not a non-empty subset"):
        ServiceProcess("broker", "broker", cpus=frozenset({4096}))
