"""``seamlessflow plan``: the simulator fitted to a real short run's summary.

The run is a real ``seamlessflow run`` (its own embedded broker, real scheduler, gateway,
trajectory manager, agents and trainer) on the emulated engine and trainer backend, whose costs
are known: the fit must find them again in the summary the run wrote."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from prometheus_client.parser import text_string_to_metric_families

from common.staleness import StalenessMode
from emulation.fit import Fit, PlanError, fit, load_summary
from emulation.plan import Candidate, ClusterShape, predict, predictions, recommend, sweep
from emulation.sim import Arm, Order, TrainerOrder
from emulation.workload import EngineCost, TrainerCost
from seamlessflow.config import RunConfig, override
from seamlessflow.costs import engine_load, lent_engines, serving_windows, trainer_workers
from seamlessflow.exceptions import ConfigError
from seamlessflow.report import trainer_report
from tests.test_cli import NO_TORCH
from tests.test_sim import agentic

ENGINE = EngineCost(a_s=0.02, b_s=0.004, prefill_s_per_token=0.0, max_batch=16)
TRAINER_S = 0.3
WEIGHT_SYNC_S = 0.2
RUN = {
    "run": "plan-fit",
    "model": {"warm_start": {"steps": 0}},
    "rollout": {"workers": 1},
    "cpus": {"placement": "none"},
    "worker": {
        "engine": {
            "kind": "emulated",
            "workload": {
                "lengths": {"median": 12, "sigma": 0.5, "cap": 32},
                "engine": dataclasses.asdict(ENGINE),
                "weight_sync_s": WEIGHT_SYNC_S,
            },
        }
    },
    "trainer": {
        "groups_per_step": 2,
        "max_staleness": 1,
        "backend": {
            "kind": "emulated",
            "workload": {"trainer": {"a_s": TRAINER_S, "s_per_token": 0.0}},
        },
    },
    "tasks": {"group_size": 4, "max_tokens": 32, "backlog": 4},
    "layout": {"kind": "disaggregated"},
    "stop": {"max_steps": 6, "max_seconds": 90},
}
"""A short disaggregated run on the emulated parts: known engine, trainer and weight costs (the
trainer's step a fixed ``TRAINER_S``: its per-token part is 0)."""


def plan(*args: str, hook: Path) -> subprocess.CompletedProcess:
    """``seamlessflow plan`` where torch, transformers and vllm cannot be imported (``hook``: a
    folder for the ``sitecustomize`` that hides them): it needs none of them."""
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(NO_TORCH)
    return subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(hook)},
    )


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real short run on the emulated parts, its summary.json."""
    tmp = tmp_path_factory.mktemp("plan")
    config = tmp / "run.toml"
    config.write_text(tomli_w.dumps({**RUN, "output_dir": str(tmp / "out")}))
    done = subprocess.run(
        [sys.executable, "-m", "seamlessflow.cli", "run", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "out" / "summary.json"


@pytest.fixture(scope="module")
def fitted(summary: Path) -> Fit:
    return fit(load_summary(summary), str(summary))


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
def test_the_fit_finds_the_emulated_costs_in_a_real_runs_summary(summary: Path, fitted: Fit):
    costs = json.loads(summary.read_text())["costs"]
    assert costs["layout"] == "disaggregated" and costs["engine load"]
    w = fitted.workload
    assert (fitted.arm, fitted.devices, fitted.trainer_devices) == (Arm.PARTIAL_ROLLOUT, 2, 1)
    assert (w.group_size, w.groups_per_step, w.agent.turns) == (4, 2, 2)
    # The engine: its iteration cost at the batches where the run made most of its tokens,
    # within 35% (the calls' times include the gateway's and the agent's own, and the weight
    # loads' pauses, on a shared machine).
    tokens = sum(n for *_, n in costs["engine load"])
    for k, _, n in costs["engine load"]:
        if n > 0.1 * tokens:
            true = ENGINE.iteration_s(k)
            assert 0.65 * true < w.engine.iteration_s(k) < 1.35 * true, (k, w.engine)
    # The trainer: a step of the run's tokens costs what the backend sleeps, plus the step's own
    # path (publish, bookkeeping) on this machine.
    assert TRAINER_S <= w.trainer.step_s(100) < TRAINER_S + 0.3
    assert WEIGHT_SYNC_S * 0.9 <= w.weight_sync_s < WEIGHT_SYNC_S + 0.5
    # Admission (the scheduler's clock) -> each session's first call (the gateway's): the
    # tasks stream, the agent runner and the gateway, fitted as the agent's start latency.
    assert 0 < costs["admission to first call seconds (mean)"] < 5
    assert w.agent.start_latency_s == costs["admission to first call seconds (mean)"]
    # No lend in a disaggregated run: its engines' pause and resume at the weight loads (each
    # worker's /metrics) stand in for a switch, and the fit says so.
    rollout = json.loads(summary.read_text())["rollout"]
    pause, resume = rollout["engine pause seconds (mean)"], rollout["engine resume seconds (mean)"]
    assert rollout["weight loads"] >= 3 and 0 < pause < 0.5 and 0 < resume < 0.5, rollout
    assert w.switch.warm_s == pytest.approx((pause + resume) / 2)
    assert any("pause and resume at weight loads" in note for note in fitted.assumed)
    # The trainer's order as the run's config had it (the defaults: drop, admission, 60 s).
    assert (costs["staleness mode"], costs["overlap"], costs["order wait seconds"]) == (
        "drop",
        False,
        60.0,
    )
    assert fitted.order == TrainerOrder(StalenessMode.DROP, Order.ADMISSION, 60.0)
    given = fit(load_summary(summary), str(summary), switch_s=0.05)  # measured elsewhere
    assert given.workload.switch.warm_s == 0.05 and not given.assumed
    # A summary written before the stall per step: fitted with the stall per checkpoint, said.
    older = load_summary(summary)
    del older["trainer"]["checkpoint stall seconds per step"]
    notes = fit(older, str(summary), switch_s=0.05).assumed
    assert len(notes) == 1 and notes[0].startswith("checkpoint stall per step"), notes


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
def test_plan_prints_a_table_and_a_recommendation_and_plots(summary: Path, tmp_path: Path):
    png = tmp_path / "plan.png"
    args = ("--devices", "3", "--max-staleness", "1", "--plot", str(png))
    done = plan(str(summary), *args, hook=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "  the trainer's order: drop mode, admission order, a step waits up to 60 s" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    assert "samples/s" in lines[header] and "idle" in lines[header]
    rows = lines[header + 1 : next(i for i, x in enumerate(lines) if x.startswith("recommended"))]
    arms = {row.split()[1] for row in rows}
    assert {"sync_colocated", "colocated", "partial_rollout", "multiplexed"} <= arms
    assert lines[header].split()[-2:] == ["thrown", "bias"]
    (rec,) = [x for x in lines if x.startswith("recommended: [layout] kind = ")]
    assert "samples/s" in rec and "staleness" in rec and "tokens thrown away" in rec
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
def test_predictions_follow_the_costs(fitted: Fit):
    w = fitted.workload
    slower = dataclasses.replace(w, trainer=TrainerCost(w.trainer.a_s * 4 + 1.0, 1e-3))
    for arm in (Arm.PARTIAL_ROLLOUT, Arm.SYNC_COLOCATED):
        (base,) = [c for c in sweep(w, 2, 0, 10, fitted.order) if c.arm is arm]
        (slow,) = [c for c in sweep(slower, 2, 0, 10, fitted.order) if c.arm is base.arm]
        assert slow.s_per_step > base.s_per_step
    small, large = (sweep(w, n, 1, 40, fitted.order) for n in (2, 6))  # 10: too few to be steady
    for arm in (Arm.SYNC_COLOCATED, Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED):
        best_small = max(c.samples_per_s for c in small if c.arm is arm)
        best_large = max(c.samples_per_s for c in large if c.arm is arm)
        assert best_large >= best_small * 0.999, arm


def test_bad_input_is_a_clear_error_and_a_nonzero_exit(tmp_path: Path):
    missing = tmp_path / "none.json"
    done = plan(str(missing), hook=tmp_path)
    assert done.returncode == 2 and "cannot read" in done.stderr and str(missing) in done.stderr
    assert "Traceback" not in done.stderr
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    done = plan(str(garbage), hook=tmp_path)
    assert done.returncode == 2 and "is not JSON" in done.stderr, done.stderr
    done = plan(str(garbage), "--switch-s", "-1", hook=tmp_path)
    assert done.returncode == 2 and "--switch-s must be >= 0" in done.stderr, done.stderr
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"steps": 3, "trainer": {}, "scheduler": {}}))
    done = plan(str(old), hook=tmp_path)
    assert done.returncode == 2 and "no 'costs' section" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_cost_is_named_with_its_file_and_section():
    summary = {
        "seconds": 10.0,
        "trainer": {"steps": 2, "step seconds (mean)": 0.5, "loss tokens": 100.0},
        "scheduler": {},
        "costs": {"layout": "disaggregated"},
    }
    with pytest.raises(PlanError, match=r"run\.json \[trainer\] has no 'phase seconds: proximal'"):
        fit(summary, "run.json")
    for phase in ("proximal", "reference", "forward", "backward"):
        summary["trainer"][f"phase seconds: {phase}"] = 0.1
    with pytest.raises(PlanError, match=r"run\.json \[costs\] has no 'rollout workers'"):
        fit(summary, "run.json")
    summary["costs"]["layout"] = "sideways"
    with pytest.raises(PlanError, match="'sideways': not one of"):
        fit(summary, "run.json")


def test_a_run_training_on_several_workers_is_planned_with_as_many():
    def colocated(count: int | str) -> RunConfig:
        layout = {"kind": "colocated", "train": {"count": count}}
        return override(RunConfig(), {"layout": layout, "rollout": {"workers": 3}})

    assert [trainer_workers(colocated(c)) for c in (1, 2, "rest")] == [1, 2, 3]
    assert trainer_workers(override(RunConfig(), {"rollout": {"workers": 3}})) == 1
    # a count it does not start is refused (the scheduler would wait for it)
    with pytest.raises(ConfigError, match=r"count = 5: .* rollout.workers = 3 colocated"):
        trainer_workers(colocated(5))
    # a disaggregated run starts its trainer group besides the rollout workers
    disaggregated = {"layout": {"train": {"count": 2}}, "rollout": {"workers": 3}}
    assert trainer_workers(override(RunConfig(), disaggregated)) == 2
    # While two of the three train, one engine serves (then none, loading the weights).
    trainer = {
        "step seconds (mean)": 2.0,
        "optimizer step -> all workers serving, seconds (mean)": 0.5,
    }
    assert serving_windows(colocated(2), [(1, 10.0)], trainer) == [(8.0, 10.0, 1), (10.0, 10.5, 0)]
    # A checkpoint every other step: half its stall is in each step, before the announcement.
    checkpointing = {**trainer, "checkpoint stall seconds per step": 0.25}
    assert serving_windows(colocated(2), [(1, 10.0)], checkpointing) == [
        (7.75, 10.0, 1),
        (10.0, 10.25, 0),
    ]

    phases = {f"phase seconds: {p}": 1.0 for p in ("proximal", "reference", "forward", "backward")}
    costs = {
        "layout": "colocated",
        "rollout workers": 3,
        "group size": 4,
        "groups per step": 2,
        "steps ahead": 2,
        "max staleness": 1,
        "max tokens": 32,
        "calls per sample": 1.0,
        "call tokens median": 12.0,
        "call tokens log sd": 0.5,
        "engine load": [[2.0, 1.0, 40.0]],
    }
    trainer = {"steps": 2, "step seconds (mean)": 3.0, "loss tokens": 400.0, **phases}
    summary = {"trainer": trainer, "scheduler": {}, "costs": costs}
    old = fit(summary)  # a summary from before "trainer workers": one, and said so
    assert old.trainer_devices == 1 and any("trainer workers" in a for a in old.assumed)
    # ... and before "rollout": no switch measured at all, the scheduler's assumption
    assert any("(the scheduler's)" in a for a in old.assumed)
    two = fit({**summary, "costs": {**costs, "trainer workers": 2}})
    assert (two.arm, two.devices, two.trainer_devices) == (Arm.COLOCATED, 3, 2)
    assert not any("trainer workers" in a for a in two.assumed)
    # Rank 0's 2 s of per-token phases a step were over half the step's 200 tokens: on two
    # devices the step is what the run measured, on one its per-token part doubles.
    assert two.workload.trainer.step_s(200, 2) == pytest.approx(3.0)
    assert two.workload.trainer.step_s(200, 1) == pytest.approx(5.0)
    assert old.workload.trainer.step_s(200, 1) == pytest.approx(3.0)
    predicted = predictions(two, 8)
    assert predicted["colocated"].trainer_devices == 2
    assert predicted["disaggregated"].trainer_devices == 1
    disaggregated = fit({**summary, "costs": {**costs, "layout": "disaggregated"}})
    assert predictions(disaggregated, 8)["colocated"].trainer_devices == 1
    # A multiplexed run starts its trainer group besides the rollout workers: 3 + 2 devices,
    # the multiplexed and disaggregated predictions on both trainer workers (a disaggregated
    # run of the config starts them too), the colocated one as the run lays it out.
    multiplexed = {"kind": "multiplexed", "train": {"count": 2}}
    run = override(RunConfig(), {"layout": multiplexed, "rollout": {"workers": 3}})
    assert (trainer_workers(run), lent_engines(run)) == (2, 2)
    mux = fit({**summary, "costs": {**costs, "layout": "multiplexed", "trainer workers": 2}})
    assert (mux.arm, mux.devices, mux.trainer_devices) == (Arm.MULTIPLEXED, 5, 2)
    shapes = {k: (c.devices, c.trainer_devices) for k, c in predictions(mux, 8).items()}
    assert shapes == {"colocated": (3, 1), "disaggregated": (5, 2), "multiplexed": (5, 2)}


def test_the_plan_simulates_the_runs_own_trainer_order():
    """A summary records how its trainer chose a step's groups (``staleness_mode``, ``overlap``,
    ``order_wait_s``); the plan simulates that trainer, not the simulator's default order."""
    phases = {f"phase seconds: {p}": 1.0 for p in ("proximal", "reference", "forward", "backward")}
    trainer = {"steps": 2, "step seconds (mean)": 3.0, "loss tokens": 400.0, **phases}
    costs = {
        "layout": "colocated",
        "rollout workers": 3,
        "trainer workers": 2,
        "group size": 4,
        "groups per step": 2,
        "steps ahead": 1,
        "max staleness": 0,
        "max tokens": 32,
        "calls per sample": 1.0,
        "call tokens median": 12.0,
        "call tokens log sd": 0.5,
        "engine load": [[2.0, 1.0, 40.0]],
    }
    older = fit({"trainer": trainer, "scheduler": {}, "costs": costs})  # before it was recorded
    assert older.order == TrainerOrder(StalenessMode.DROP, Order.ADMISSION, 60.0)
    assert any(note.startswith("the trainer's order: not in the summary") for note in older.assumed)
    recorded = {"staleness mode": "drop", "overlap": True, "order wait seconds": 5.0}
    ahead = fit({"trainer": trainer, "scheduler": {}, "costs": {**costs, **recorded}})
    assert ahead.order == TrainerOrder(StalenessMode.DROP, Order.OVERLAP, 5.0)
    assert not any("trainer's order" in note for note in ahead.assumed)
    # A trainer computing ahead overlaps the wait for a step's last groups with the step's
    # compute: on this trainer-bound workload, a colocated step is shorter than in admission
    # order, the step's 2 x 1 s of per-token work a group at a time as the groups complete.
    assert predictions(ahead, 20)["colocated"].s_per_step < 0.9 * (
        predictions(older, 20)["colocated"].s_per_step
    )
    bad = {**costs, **recorded, "staleness mode": "sideways", "order wait seconds": -1}
    with pytest.raises(PlanError, match=r"run.json \[costs\] is not a trainer's order: ") as e:
        fit({"trainer": trainer, "scheduler": {}, "costs": bad}, "run.json")
    assert "'staleness mode' Input should be 'drop' or 'downweight'" in str(e.value)
    assert "'order wait seconds' Input should be greater than or equal to 0" in str(e.value)


def test_a_checkpoints_stall_is_spread_over_the_steps():
    """A checkpoint is due every few versions: the summary gives its stall per checkpoint and
    per step (what the planner and the serving windows add to a step), from the trainer's
    /metrics."""
    exposition = """# TYPE sf_trainer_steps_total counter
sf_trainer_steps_total 4.0
# TYPE sf_trainer_checkpoint_stall_seconds histogram
sf_trainer_checkpoint_stall_seconds_bucket{le="+Inf"} 2.0
sf_trainer_checkpoint_stall_seconds_count 2.0
sf_trainer_checkpoint_stall_seconds_sum 0.6
"""
    samples = [s for f in text_string_to_metric_families(exposition) for s in f.samples]
    report = trainer_report(samples)
    assert report["checkpoint stall seconds (mean)"] == pytest.approx(0.3)
    assert report["checkpoint stall seconds per step"] == pytest.approx(0.15)
    assert trainer_report([])["checkpoint stall seconds per step"] == 0.0  # no step, no /metrics


def test_engine_load_leaves_out_what_the_engines_did_not_serve():
    # Two calls on one engine: 0-4 s (10 tokens) and 1-3 s (4 tokens); no engine serves in
    # 2-3 s (a weight load), and from 3 s a second engine does (a lent trainer's).
    spans = [(0.0, 4.0, 10), (1.0, 3.0, 4)]
    load = engine_load(spans, 1, [(2.0, 3.0, 0), (3.0, 10.0, 2)])
    # serving time: the first call 3 s (10/3 tokens a second), the second 1 s (4 a second)
    assert load == [
        [0.5, 1.0, round(10 / 3, 2)],  # 3-4 s: one call on two engines
        [1.0, 1.0, round(10 / 3, 2)],  # 0-1 s: one call on one engine
        [2.0, 1.0, round(10 / 3 + 4, 2)],  # 1-2 s: two calls on one engine
    ]
    assert engine_load(spans, 1) == [[1.0, 2.0, 5.0], [2.0, 2.0, 9.0]]


@pytest.mark.newest_nats
@pytest.mark.timeout(300)
def test_a_cluster_by_tags_gets_only_the_layouts_its_tags_allow(fitted: Fit, tmp_path: Path):
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        '[[devices]]\ntags = ["train", "rollout", "gpu=h200"]\ncount = 2\n'
        '[[devices]]\ntags = ["rollout"]\ncount = 3\n'
    )
    shape = ClusterShape.read(cluster)
    assert (shape.both, shape.train, shape.rollout, shape.devices) == (2, 0, 3, 5)
    found = sweep(fitted.workload, shape, 0, 8, fitted.order)
    # Rollout-only devices never train: no colocated layout, at most 2 trainer devices.
    assert found and all(c.arm is not Arm.SYNC_COLOCATED for c in found)
    assert {c.trainer_devices for c in found} == {1, 2}
    assert {c.arm for c in found} >= {Arm.PARTIAL_ROLLOUT, Arm.MULTIPLEXED}
    trainers_only = ClusterShape(train=2, rollout=3)  # no device may be lent
    unlent = sweep(fitted.workload, trainers_only, 0, 8, fitted.order)
    assert {c.arm for c in unlent} == {Arm.PARTIAL_ROLLOUT, Arm.DISAGGREGATED}
    assert {c.trainer_devices for c in unlent} == {2}  # the train-only devices train
    cluster.write_text("[[devices]]\ntags = 3\n")
    with pytest.raises(PlanError, match=r"devices\[0\] must be a table of tags and a count"):
        ClusterShape.read(cluster)
    cluster.write_text('[[devices]]\ntags = ["gpu=h200"]\n')
    with pytest.raises(PlanError, match=r"no \[\[devices\]\] tagged train or rollout"):
        ClusterShape.read(cluster)


def test_the_plan_shows_what_a_configuration_throws_away():
    """Long-tailed lengths at staleness 1 in drop mode: a trainer taking groups as they complete
    drops the long ones (tokens thrown away, the trained samples shorter than drawn); the real
    trainer's admission order keeps them. The plan says so beside the speed."""
    w, shape = agentic(), (Arm.PARTIAL_ROLLOUT, 16, 3, 1, 24)
    completion = predict(w, *shape, TrainerOrder(order=Order.COMPLETION, wait_s=20.0))
    admission = predict(w, *shape, TrainerOrder(wait_s=20.0))
    assert completion.thrown > 0.1 and completion.bias < 0.95
    assert admission.thrown < 0.03 and admission.bias >= 0.98


def test_a_tie_is_recommended_fresher_with_fewer_role_switches():
    def candidate(arm: Arm, staleness: int, samples_per_s: float = 10.0) -> Candidate:
        return Candidate(arm, 8, 2, staleness, samples_per_s, 1.0, 0.1, 0.0, 1.0)

    tied = [
        candidate(arm, staleness)
        for arm in (Arm.COLOCATED, Arm.MULTIPLEXED, Arm.PARTIAL_ROLLOUT, Arm.SYNC_COLOCATED)
        for staleness in (1, 2)
    ]
    best = recommend(tied)
    assert (best.arm, best.staleness) == (Arm.PARTIAL_ROLLOUT, 1)
    faster = candidate(Arm.COLOCATED, 2, samples_per_s=10.5)
    assert recommend([*tied, faster]) is faster
    # the synchronous baseline is not a layout a run can have, however fast
    assert recommend([*tied, candidate(Arm.SYNC_COLOCATED, 0, 99.0)]) is best
