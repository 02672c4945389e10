"""A run submitted with ``sbatch`` to a real Slurm on namespace nodes (``tests.slurm_cluster``:
Debian's slurmctld and a slurmd per node; marker ``cluster``, root only).

``seamlessflow slurm`` renders and submits the run (tiny model, hf engine, arithmetic tasks) on
4 nodes: 3 NATS servers in a route cluster on the first three (the streams with 3 replicas),
the trajectory manager, scheduler, gateway and agent runner on the first, a rollout worker on
each of the first three and the trainer on the fourth. The test feeds tasks through NATS (a node
address, over the bridge) and watches the trainer reach ``STEPS`` steps, then checks that
rewards flowed, no task was lost (every one ended as its whole group, none dead-lettered), no
sample was trained twice (the trainer's steps log), every worker loaded the trainer's weights
through the object store (none is beside the trainer), and the batch log and registry say which
node ran what. ``scancel --batch --signal=TERM`` then stops the parts and NATS after them:
the job completes, no process is left on any node, each part's log ends with its stop and no
part saw NATS go. Submitted again, the run resumes from the trainer's checkpoint, and a plain
``scancel`` (every step at once) stops it too, leaving nothing on the nodes.
"""

import asyncio
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from broker.client import session
from broker.exceptions import BrokerError
from broker.messages import SampleReady, SessionEnded
from broker.server import find_nats_server
from broker.subjects import Durable, RunNames
from rollout.agents.arithmetic import arithmetic_tasks
from seamlessflow.submit import submit_tasks
from tests.nodes import Cluster
from tests.slurm_cluster import SlurmCluster, available
from tests.support import eventually, registered, stream_messages
from trainer.checkpoint import read_steps

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

ROOT = Path(__file__).parents[1]
RUN = "slurmrun"
NODES = 4
STEPS = 3
TASKS = 5
GROUP = 4
LOADED = re.compile(r"weights_loaded version=(\d+) .*path=(\w+)")
FAILED_LOAD = re.compile(r"weights_load_failed .*")
SMALL_STREAM = {"max_bytes": 4 << 20, "max_age_s": 3600.0}
STOPPED = {  # what each part prints when it stopped cleanly
    "trajectory": r"(?m)^trajectory stopped$",
    "scheduler": r"(?m)^scheduler stopped$",
    "gateway": r"gateway_stopped",
    "agents": r"(?m)^agents stopped$",
    "trainer": r"(?m)^trainer stopped$",
    "rollout": r"(?m)^worker rollout-sfn-node\d-0 stopped$",
}


def _bin(folder: Path) -> Path:
    """``seamlessflow`` on the nodes' PATH: this checkout's, on this Python."""
    folder.mkdir()
    wrapper = folder / "seamlessflow"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m seamlessflow.cli "$@"\n')
    wrapper.chmod(0o755)
    return folder


def _config(run_toml, tmp_path: Path, model: Path) -> tuple[Path, Path]:
    logs = tmp_path / "slurm-logs"
    checkpoints = tmp_path / "checkpoints"
    path = run_toml(
        RUN,
        model={"name": str(model)},
        tasks={"group_size": GROUP},
        provision={"replicas": 3, **{p: SMALL_STREAM for p in ("tasks", "gen", "traj")}},
        trainer={
            "groups_per_step": 1,
            "max_staleness": 4,
            "worker_id": "trainer",
            "checkpoint_dir": str(checkpoints),
        },
        supervise={"max_restarts": 1, "backoff_s": 1.0},
        slurm={
            "job_name": "sf-test",
            "time": "00:10:00",
            "log_dir": str(logs),
            "setup": [
                f"export PATH={_bin(tmp_path / 'bin')}:$PATH",
                f"export PYTHONPATH={ROOT}",
                "export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1",
            ],
            "nats_server": str(find_nats_server()),
            "nats_store": str(tmp_path / "nats-store"),
            "nats_max_file_store": "1G",
            "rollout": {"nodes": NODES - 1, "workers_per_node": 1},
        },
    )
    return path, checkpoints


@pytest.mark.timeout(360)
async def test_a_run_submitted_with_sbatch_trains_across_nodes(tmp_path, tiny_model_dir, run_toml):
    config, checkpoints = _config(run_toml, tmp_path, tiny_model_dir)
    with (
        Cluster(NODES, tmp_path / "nodes") as cluster,
        SlurmCluster(cluster, tmp_path / "slurm") as slurm,
    ):
        sinfo = slurm.command("sinfo", "-h", "-N", "-o", "%N %t")
        assert sorted(sinfo.split()) == sorted([*(n.hostname for n in cluster), *["idle"] * NODES])
        job = _submit(slurm, config, tmp_path)
        job_dir = tmp_path / "slurm-logs" / job
        try:
            await _watch(cluster, slurm, job, job_dir, checkpoints)
            _cancel(cluster, slurm, job, job_dir)
        except BaseException:
            print(_logs(tmp_path / "slurm-logs", job))
            raise
        # Submitted again, the run resumes from the trainer's checkpoint; a plain scancel (every
        # step at once, NATS too) still stops every part and leaves nothing on the nodes.
        job = _submit(slurm, config, tmp_path)
        try:
            await _resumed(cluster, slurm, job, len(read_steps(checkpoints)))
            _plain_cancel(slurm, job, tmp_path / "slurm-logs" / job)
        except BaseException:
            print(_logs(tmp_path / "slurm-logs", job))
            raise


def _submit(slurm: SlurmCluster, config: Path, tmp_path: Path) -> str:
    """``seamlessflow slurm CONFIG``: rendered and submitted with sbatch; the job id."""
    hidden = ("SEAMLESSFLOW_STATE_DIR", "XDG_STATE_HOME", "SEAMLESSFLOW_NATS_URL")
    env = {k: v for k, v in slurm.env.items() if k not in hidden}
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "slurm", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return re.search(r"submitted job (\d+)", done.stdout)[1]


async def _resumed(cluster: Cluster, slurm: SlurmCluster, job: str, version: int) -> None:
    slurm.wait(lambda: slurm.job_state(job) == "RUNNING", 30, f"job {job} running")
    url = ",".join(f"nats://{node.address}:4222" for node in cluster.nodes[:3])
    names = RunNames(RUN)
    async with session(url, "pytest-slurm", give_up_after=120) as nc:
        js = nc.jetstream()

        async def up() -> bool:
            try:
                entries = [await registered(js, names, w) for w in _workers(cluster)]
                trainer = await registered(js, names, "trainer")
            except Exception:  # not provisioned yet
                return False
            return all(entries) and trainer is not None and trainer.version == version

        await eventually(up, timeout=120)


def _workers(cluster: Cluster) -> list[str]:
    return [f"rollout-{node.hostname}-0" for node in cluster.nodes[:3]]


def _plain_cancel(slurm: SlurmCluster, job: str, job_dir: Path) -> None:
    """Plain ``scancel``: SIGTERM to every step at once, SIGKILL after ``KillWait``. The parts
    stop (one still waiting on NATS, which stopped beside it, is killed); nothing is left."""
    slurm.command("scancel", job)
    slurm.wait(lambda: slurm.job_state(job) not in ("RUNNING", "COMPLETING"), 90, "job end")
    assert slurm.job_state(job) == "CANCELLED"
    slurm.wait(lambda: not slurm.job_processes(), 30, "nodes empty of the job's processes")
    clean = {
        log.name: bool(re.search(line, log.read_text()))
        for part, line in STOPPED.items()
        for log in sorted(job_dir.glob(f"{part}*.log"))
    }
    assert len(clean) == len(STOPPED) + 2  # every part had its log (3 workers)
    print(f"plain scancel: stopped cleanly {clean}")


async def _watch(cluster, slurm, job: str, job_dir: Path, checkpoints: Path) -> None:
    started = time.monotonic()
    slurm.wait(lambda: slurm.job_state(job) == "RUNNING", 30, f"job {job} running")
    assert slurm.command("squeue", "-h", "-j", job, "-o", "%T %D %N").split()[:2] == [
        "RUNNING",
        str(NODES),
    ]
    url = ",".join(f"nats://{node.address}:4222" for node in cluster.nodes[:3])
    names = RunNames(RUN)
    async with session(url, "pytest-slurm", give_up_after=120) as nc:
        js = nc.jetstream()

        async def provisioned() -> bool:
            try:
                await js.stream_info(names.tasks_stream)
                return True
            except Exception:
                return False

        await eventually(provisioned, timeout=90)
        tasks = arithmetic_tasks(
            random.Random(7), TASKS, max_operand=9, group_size=GROUP, max_turns=1, prefix="s"
        )
        for attempt in range(30):  # the new streams elect their leaders first
            try:
                await submit_tasks(js, names, tasks, progress=False)
                break
            except BrokerError:
                if attempt == 29:
                    raise
                await asyncio.sleep(1.0)

        workers = _workers(cluster)

        async def trained() -> bool:
            entry = await registered(js, names, "trainer")
            return entry is not None and (entry.version or 0) >= STEPS

        async def all_ended() -> bool:
            info = await js.stream_info(names.traj_stream)
            return info.state.messages > 0 and len(await _ended(js, names)) >= TASKS * GROUP

        async def following() -> bool:  # every worker loaded one of the trainer's versions
            entries = [await registered(js, names, w) for w in workers]
            return all(e is not None and (e.version or 0) >= 1 for e in entries)

        await eventually(trained, timeout=200)
        await eventually(all_ended, timeout=60)
        await eventually(following, timeout=60)
        print(f"\n{STEPS} steps, {TASKS} tasks ended in {time.monotonic() - started:.0f} s")

        # Every part ran where the script put it: the registry's hosts, the batch log.
        hosts = {w: (await registered(js, names, w)).host for w in ["trainer", *workers]}
        assert hosts["trainer"].startswith(cluster[3].hostname), hosts
        for worker, node in zip(workers, cluster.nodes[:3], strict=True):
            assert hosts[worker].startswith(node.hostname), hosts
        info = await js.stream_info(names.weights_stream)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2

        # Rewards flowed, no task lost: each ended as a whole group, none dead-lettered.
        ended = await _ended(js, names)
        per_task = Counter(e.task_id for e in ended)
        assert per_task == {t.task_id: GROUP for t in tasks}, per_task
        rewards = {e.session_id: e.reward for e in ended}
        samples = await stream_messages(js, names.samples_stream, SampleReady)
        assert {s.session_id for s in samples} == set(rewards)  # every session became samples
        assert all(s.reward == rewards[s.session_id] for s in samples)
        dead = await js.stream_info(names.dead_stream)
        assert dead.state.messages == 0
        pending = await js.consumer_info(names.tasks_stream, Durable.SCHEDULER)
        assert pending.num_pending == 0 and pending.num_ack_pending == 0

    # No sample trained twice; versions consecutive (the trainer's steps log).
    steps = read_steps(checkpoints)
    trained_ids = [sid for step in steps for sid in step.trained]
    assert len(steps) >= STEPS and trained_ids and len(trained_ids) == len(set(trained_ids))
    assert [s.version for s in steps] == list(range(1, len(steps) + 1))
    # Every worker took the trainer's weights from the object store: none is on its node.
    for node in cluster.nodes[:3]:
        (path,) = job_dir.glob(f"rollout-{node.hostname}-*.log")  # -<the step's task rank>
        log = path.read_text()
        loads = [(int(m[1]), m[2]) for m in LOADED.finditer(log)]
        assert loads and all(path == "store" for _, path in loads), log[-2000:]
        for failed in FAILED_LOAD.findall(log):  # (a version missed: the next one is loaded)
            print(f"{path.name}: {failed}")


async def _ended(js, names: RunNames) -> list[SessionEnded]:
    ended = await stream_messages(js, names.traj_stream, SessionEnded, subject=names.traj_end)
    return list({e.session_id: e for e in ended}.values())


def _cancel(cluster: Cluster, slurm: SlurmCluster, job: str, job_dir: Path) -> None:
    """``scancel --batch --signal=TERM``: the script stops the parts, then NATS, and ends."""
    batch_log = job_dir.parent / f"sf-test-{job}.log"
    batch = batch_log.read_text()
    assert f"trainer on {cluster[3].hostname}" in batch
    assert f"trajectory on {cluster[0].hostname}" in batch
    for n in range(3):
        assert f"nats-{n} on {cluster[n].hostname}" in batch
    rollout = ",".join(node.hostname for node in cluster.nodes[:3])
    assert f"rollout workers (1 a node) on {rollout}" in batch
    cancelled = time.strftime("%Y-%m-%d %H:%M:%S")
    slurm.command("scancel", "--batch", "--signal=TERM", job)
    slurm.wait(lambda: slurm.job_state(job) not in ("RUNNING", "COMPLETING"), 90, "job end")
    assert slurm.job_state(job) == "COMPLETED", batch_log.read_text()
    slurm.wait(lambda: not slurm.job_processes(), 30, "nodes empty of the job's processes")
    assert "stopping: the parts, then NATS" in batch_log.read_text()
    for part, line in STOPPED.items():
        logs = sorted(job_dir.glob(f"{part}*.log"))
        assert logs, part
        for log in logs:
            text = log.read_text()
            assert "Traceback" not in text, text[-3000:]
            assert re.search(line, text), f"{log.name}:\n{text[-2000:]}"
            # NATS outlived the part: no connection refused while it stopped
            late = [x for x in text.splitlines() if x[:19] >= cancelled and "nats_error" in x]
            assert not late, f"{log.name}: {late[:3]}"
    for n in range(3):
        assert "Server Exiting" in (job_dir / f"nats-{n}.log").read_text()


def _logs(log_dir: Path, job: str) -> str:
    parts = []
    for path in [log_dir / f"sf-test-{job}.log", *sorted((log_dir / job).glob("*.log"))]:
        if path.is_file():
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)
