"""``seamlessflow run``: the whole RL loop (warm start, trajectory manager, trainer, hf rollout
worker, gateway, agent runner) on the tiny model for a few steps through a real nats-server, then
the data it left on the broker is checked for consistent versions and labels."""

import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from nats.errors import TimeoutError as NatsTimeoutError
from safetensors.torch import load, load_file

from broker import codec
from broker.messages import Role, SampleReady, SessionEnded, TaskSubmitted, WeightsPublished
from broker.registry import Sighting
from broker.subjects import Durable, RunNames
from broker.weights import fetch_weights
from broker.worker_messages import WorkerRegistered
from rollout.engines import VLLMEngineConfig
from seamlessflow.config import RunConfig, load_config, override
from seamlessflow.exceptions import ConfigError
from seamlessflow.feed import TaskFeed, task_number
from seamlessflow.progress import RunStats
from seamlessflow.report import node_parts
from seamlessflow.targets import target_group
from tests.support import stream_messages
from trainer.checkpoint import read_steps
from trainer.config import MegatronBackendConfig, TorchBackendConfig

STEPS = 4
GROUP = 4


@pytest.mark.newest_nats
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("layout", "lend"),
    [("disaggregated", False), ("multiplexed", False), ("colocated", True), ("colocated", False)],
    ids=["disaggregated", "multiplexed", "colocated-lending", "colocated"],
)
async def test_run_trains_the_tiny_model_through_the_data_plane(
    broker, js, run_name, tmp_path, run_toml, layout, lend
):
    out = tmp_path / "out"
    # ``lend``: the colocated worker lends the device's memory at every switch, as it does on a
    # GPU: its engine sleeps while it trains (here only the engine's side of it: a CPU frees
    # nothing). Without, as on a CPU by default, its engine stays warm.
    worker = {"lend_memory": True} if lend else {}
    config = run_toml(
        run_name,
        tasks={"group_size": GROUP},
        trainer={"groups_per_step": 2, "max_staleness": 2},
        layout={"kind": layout},
        worker=worker,
        stop={"max_steps": STEPS, "max_seconds": 240},
    )
    env = {**os.environ, "SEAMLESSFLOW_MODELS": str(tmp_path / "models"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "run", str(config), "--nats", broker.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"max_steps ({STEPS})" in done.stdout
    assert "step " in done.stdout and "tok/s" in done.stdout  # the progress line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= STEPS and summary["sessions"] >= 2 * STEPS * GROUP
    assert summary["trainer"]["samples trained"] >= 2 * STEPS * GROUP  # read from its /metrics
    # The scheduler admitted the tasks within the staleness bound: nothing was dropped as stale.
    scheduler = summary["scheduler"]
    assert (
        scheduler["tasks admitted"] >= 2 * STEPS
        and summary["trainer"]["samples stale_dropped"] == 0
    )
    # The scheduler saw no worker but the layout's: a trainer and a rollout worker, or one. Its
    # gauge counts the workers live at its last tick; one whose heartbeat is late then (a loaded
    # CI machine) is left out, so it may read one less. The registry below counts them all.
    assert 1 <= scheduler["workers"] <= (1 if layout == "colocated" else 2)
    if layout != "disaggregated":  # the trainer's worker served rollout while the trainer waited
        assert scheduler["lends"] >= 1 and scheduler["reclaims"] >= 1
    # Alone in the run with its engine warm (colocated, not lending memory), the trainer's
    # worker took each version in process, in the step, and it was held there, no file
    # written; asleep while it trains (lending memory), or beside another worker, never.
    alone_warm = layout == "colocated" and not lend
    in_process = summary["rollout"]["weight loads in process"]
    assert (in_process >= 1) == alone_warm, summary["rollout"]
    held = summary["trainer"]["weight versions held in process"]
    assert (held >= 1) == alone_warm, summary["trainer"]
    # Role changes repeated nothing: no sample was trained twice, versions are consecutive.
    steps = read_steps(out / "checkpoints")
    trained = [sid for step in steps for sid in step.trained]
    assert trained and len(trained) == len(set(trained))
    assert [step.version for step in steps] == list(range(1, len(steps) + 1))
    assert scheduler["workers fenced"] == 0
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Which node ran what: all on this one, the workers by id and role at the end.
    (parts,) = summary["nodes"].values()
    assert list(summary["nodes"]) == [socket.gethostname()]
    assert {"agents", "gateway", "scheduler", "trajectory"} <= set(parts)
    ran = [part for part in parts if part.startswith("worker ")]  # "worker <id> (<role>)"
    assert len(ran) == (1 if layout == "colocated" else 2), parts
    assert summary["scheduler_lease"].startswith("scheduler-")
    # Each child ran on its resolved config: the run's, with what is the child's own filled in.
    workers = ["trainer"] if layout == "colocated" else ["trainer", "rollout-0"]
    children = {p.stem: load_config(p) for p in (out / "configs").glob("*.json")}
    assert sorted(children) == sorted(["scheduler", "trajectory", "gateway", "agents", *workers])
    assert all(c.run == run_name and c.trainer.groups_per_step == 2 for c in children.values())
    assert children["gateway"].gateway.port > 0  # the port it bound: a restart listens there
    gateway = f"http://127.0.0.1:{children['gateway'].gateway.port}/v1"
    assert children["agents"].agents.gateway == gateway
    # The gateway checked keys (a fresh keys file of the run); the agents called with theirs.
    assert children["gateway"].gateway.keys_file == out / "gateway_keys.toml"
    assert children["agents"].agents.gateway_key_file == out / "agents.key"
    assert all((out / f).stat().st_mode & 0o777 == 0o600 for f in ("agents.key", "metrics.key"))
    if layout != "disaggregated":
        assert children["trainer"].worker.tags == ["train", "rollout"]
    # A colocated worker trains on all the CPUs but generates on a rollout worker's threads
    # (on as many as it trains with, its engine stalls beside the data plane's processes);
    # the others' engines take their process's threads, one per CPU of its set. (A
    # disaggregated trainer runs no engine.)
    engines = ["rollout-0"] if layout == "disaggregated" else workers
    engine_threads = 1 if layout == "colocated" else None
    assert all(children[w].worker.engine.threads == engine_threads for w in engines)

    names = RunNames(run_name)
    weights = await stream_messages(js, names.weights_stream, WeightsPublished)
    last = weights[-1].version
    assert last >= STEPS
    ended = await stream_messages(js, names.traj_stream, SessionEnded, subject=names.traj_end)
    samples = await stream_messages(js, names.samples_stream, SampleReady)
    assert samples

    # Every sample: labels consistent with the mask, versions within what was published.
    for s in samples:
        for mask, logprob, version in zip(s.loss_mask, s.logprobs, s.versions, strict=True):
            if mask:
                assert 0 <= version <= last and logprob <= 0.0
            else:
                assert version == -1 and logprob == 0.0
        loss_versions = {v for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
        assert s.on_policy == (len(loss_versions) == 1)
        assert s.reward in (0.0, 0.5, 1.0) and s.group_size == GROUP

    # Groups are whole: GROUP sessions per task, one SessionEnded each, rewards that agree.
    rewards = {e.session_id: e.reward for e in ended}
    sessions_by_group = defaultdict(set)
    for s in samples:
        assert rewards[s.session_id] == s.reward
        sessions_by_group[s.group_id].add(s.session_id)
    complete = [g for g in sessions_by_group.values() if len(g) == GROUP]
    assert len(complete) >= 2 * STEPS  # groups_per_step complete groups per trainer step

    # Later policy versions generated tokens: rollout followed the trainer.
    generated = {v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
    assert len(generated) >= 2 and max(generated) >= 1

    # Reward statistics move: the policy trained on varied rewards and its weights changed.
    assert len({e.reward for e in ended}) >= 2
    (start,) = (tmp_path / "models").glob("tiny-llama-warm-*")  # the warm-started policy
    first = load_file(start / "model.safetensors")
    final = load(await fetch_weights(js, weights[-1]))
    assert final.keys() <= first.keys()
    assert any(not torch.equal(first[k], final[k]) for k in final)


def test_the_report_says_which_node_ran_what():
    targets = [
        target_group("http://127.0.0.1:9401/metrics", "trajectory", "r"),  # this node's
        target_group("http://node0:9402/metrics", "scheduler", "r"),
        target_group("http://node4:9402/metrics", "scheduler", "r"),  # a standby
        target_group("http://node4:9404/metrics", "trainer", "r"),  # by id, from the registry
        target_group("http://node1:9410/metrics", "worker", "r"),
    ]

    def seen(worker_id: str, host: str, role: Role) -> Sighting:
        entry = WorkerRegistered(worker_id=worker_id, host=host, pid=1, role=role, heartbeat_at=0.0)
        return Sighting(worker_id, entry, written_at=0.0)

    workers = [
        seen("trainer", "node4", Role.TRAIN),
        seen("w1", "node1", Role.ROLLOUT),
        Sighting("gone", None, written_at=0.0),  # deleted: ran nowhere now
    ]
    assert node_parts(targets, workers, here="node0") == {
        "node0": ["scheduler", "trajectory"],
        "node1": ["worker w1 (rollout)"],
        "node4": ["scheduler", "worker trainer (train)"],
    }


def test_progress_core_scores_a_session_once_and_tracks_staleness():
    def sample(session: str, versions: list[int], reward: float) -> SampleReady:
        n = len(versions) + 1
        return SampleReady(
            sample_id=f"{session}-{len(versions)}",
            session_id=session,
            group_id="g",
            token_ids=list(range(n)),
            loss_mask=[0] + [1] * (n - 1),
            logprobs=[0.0] + [-0.5] * (n - 1),
            versions=[-1, *versions],
            reward=reward,
            on_policy=len(set(versions)) == 1,
        )

    stats = RunStats(started_at=0.0)
    stats.on_weights(
        WeightsPublished(
            version=3, location="file:///w", sha256="0" * 64, size_bytes=1, published_at=1.0
        ),
        1.0,
    )
    stats.on_sample(sample("a", [1, 2], 1.0), 2.0)
    stats.on_sample(sample("a", [2], 1.0), 2.0)  # a second leaf of the same session
    stats.on_sample(sample("b", [3], 0.0), 3.0)
    assert len(stats.sessions) == 2 and stats.samples == 3
    assert stats.reward_mean() == 0.5
    assert stats.staleness() == 1.0  # (3 - 1) and (3 - 3): the oldest loss token counts
    assert stats.curve() == [(2, 1.0, 1), (3, 0.0, 1)]
    assert "version 3" in stats.line(4.0)
    assert stats.tool_curve() == [] and "tool calls" not in stats.line(4.0)
    # Sessions whose agent counted its tool calls (SessionEnded metrics, before the sample).
    for session, calls in (("c", 1.0), ("d", 0.0), ("e", 2.0)):
        stats.on_end(
            SessionEnded(session_id=session, reward=1.0, metrics={"tool_calls": calls}), 4.0
        )
    stats.on_sample(sample("c", [3], 1.0), 5.0)
    stats.on_sample(sample("d", [3], 0.0), 5.0)
    stats.on_sample(sample("e", [4], 1.0), 5.0)
    assert stats.tool_curve() == [(3, 0.5, 2), (4, 2.0, 1)]  # b (version 3) counted none
    assert stats.tool_calls_mean() == 1.0 and "tool calls 1.00" in stats.line(6.0)


@pytest.mark.parametrize(
    ("toml", "error"),
    [
        ("[tasks]\ngroup_size = 0\n", "group_size"),
        # a trainer group it would not start: the scheduler would wait for it until its
        # placement timeout
        (
            "[layout]\nkind = 'colocated'\ntrain = { count = 3 }\n[rollout]\nworkers = 2\n",
            "rollout.workers = 2 colocated workers",
        ),
    ],
    ids=["invalid", "colocated-group"],
)
def test_run_refuses_a_bad_config(tmp_path: Path, toml, error):
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert error in done.stderr and "Traceback" not in done.stderr


def test_a_run_its_broker_cannot_serve_says_why(tmp_path: Path):
    """A run's account that does not fit the embedded broker's JetStream (a disk with less
    free than ``[broker.account] max_file``) is not served: the run stops with that reason,
    not with its identity refused."""
    config = tmp_path / "run.toml"
    out = tmp_path / "out"
    config.write_text(f'output_dir = "{out}"\n[broker.account]\nmax_file = {1 << 60}\n')
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    error = done.stderr.splitlines()[-1]
    assert "cannot serve run" in error and f"reserves {1 << 60} bytes of storage" in error
    assert "[broker.account] max_file" in error and "Traceback" not in done.stderr


def _loaded(tmp_path: Path, toml: str) -> RunConfig:
    """The run config a file of ``toml`` loads to (``ConfigError`` if it is refused)."""
    config = tmp_path / "run.toml"
    config.write_text(toml)
    return load_config(config)


def test_the_trainer_must_score_at_the_agents_sampling_temperature(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"trainer.temperature \(1.0\) must equal"):
        _loaded(tmp_path, "[agents]\ntemperature = 0.7\n")
    both = _loaded(tmp_path, "[agents]\ntemperature = 0.7\n[trainer]\ntemperature = 0.7\n")
    assert both.trainer.temperature == 0.7


def test_example_configs_load_and_the_quickstart_one_is_the_defaults():
    examples = Path(__file__).parent.parent / "examples"
    assert load_config(examples / "run.toml") == RunConfig()
    smollm2 = load_config(examples / "smollm2.toml")
    assert smollm2.model.name == "smollm2" and smollm2.worker.engine == VLLMEngineConfig()
    assert smollm2.worker.max_running == 64 and smollm2.trainer.backend == TorchBackendConfig()
    tools, baseline = (
        load_config(examples / "tools.toml"),
        load_config(examples / "tools_baseline.toml"),
    )
    assert (tools.tasks.env, tools.tasks.tools, baseline.tasks.tools) == ("calculator", True, False)
    # the baseline differs in the tool only (and its run name)
    assert baseline == override(tools, {"run": baseline.run, "tasks": {"tools": False}})


def test_a_trainer_group_takes_one_rank_a_worker(tmp_path: Path):
    """A group member with local ranks is refused its place (``trainer.group``): the config
    that would make one is refused at load, naming both settings."""
    with pytest.raises(ConfigError, match=r"count = 2 .* trainer.world_size = 1 \(it is 4\)"):
        _loaded(tmp_path, "[layout.train]\ncount = 2\n[trainer]\nworld_size = 4\n")
    assert _loaded(tmp_path, "[layout.train]\ncount = 2\n").trainer.world_size == 1
    one_trainer = _loaded(tmp_path, "[trainer]\nworld_size = 4\n")  # four local ranks
    assert one_trainer.trainer.world_size == 4


def test_a_kind_chosen_section_takes_only_its_own_options(tmp_path: Path):
    """Engines and trainer backends are chosen by ``kind``; changing the kind drops the default
    kind's options, and an option of another kind is an error naming the key."""
    megatron = _loaded(tmp_path, "[trainer.backend]\nkind = 'megatron'\ntensor_parallel = 1\n")
    assert megatron.trainer.backend == MegatronBackendConfig()
    with pytest.raises(ConfigError, match=r"worker.engine.hf.kv_cache_memory_bytes\s+Extra inputs"):
        _loaded(tmp_path, "[worker.engine]\nkind = 'hf'\nkv_cache_memory_bytes = 1\n")
    with pytest.raises(ConfigError, match=r"trainer.backend\s+Input tag 'deepspeed' found"):
        _loaded(tmp_path, "[trainer.backend]\nkind = 'deepspeed'\n")
    with pytest.raises(ConfigError, match="the megatron backend runs on CUDA only"):
        _loaded(tmp_path, "[trainer]\ndevice = 'cpu'\n[trainer.backend]\nkind = 'megatron'\n")


def test_a_colocated_run_may_have_several_workers(tmp_path: Path):
    """Only the trainer group's rank 0 takes samples (``trainer.group``): several workers
    tagged train no longer stall a run, so the colocated layout takes ``rollout.workers``."""
    for layout in ("colocated", "multiplexed"):
        config = _loaded(tmp_path, f'[layout]\nkind = "{layout}"\n[rollout]\nworkers = 2\n')
        assert config.rollout.workers == 2, layout


async def test_a_restarted_runs_task_feed_numbers_on_from_the_tasks_stream(nc, js, names):
    """A second feed on the same run (the run restarted) names new tasks: none is dropped as a
    duplicate of the first feed's, whose ids it does not reuse. (Each feed numbered from 0: its
    first tasks had the ids of the first run's, and JetStream dropped them.)"""
    config = RunConfig.model_validate({"run": names.run, "tasks": {"backlog": 3}})
    scheduler = await js.pull_subscribe_bind(Durable.SCHEDULER, names.tasks_stream)
    ids = []
    for _ in range(2):  # the run, then the run restarted
        await TaskFeed(nc, names, config).top_up()
        try:
            taken = await scheduler.fetch(3, timeout=5)  # the scheduler admits them all
        except NatsTimeoutError:
            taken = []
        for msg in taken:
            await msg.ack_sync()
        ids.append([codec.decode(TaskSubmitted, m.data).task_id for m in taken])
    assert len(ids[1]) == 3 and not set(ids[0]) & set(ids[1]), ids
    assert [task_number(t) for t in ids[0] + ids[1]] == list(range(6))
