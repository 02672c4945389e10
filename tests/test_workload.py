"""The shared workload model: sampler statistics, costs, and the dict round-trip."""

import json
import math
import random
import statistics

import pytest

from emulation.sim.measure import quantile
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    Phase,
    SwitchCost,
    TrainerCost,
    Workload,
)


def test_lengths_are_lognormal_with_the_stated_tail_before_the_cap():
    model = LengthModel(median=100, sigma=0.99, cap=10**9, group_corr=0.0)
    rng = random.Random(1)
    xs = [x for _ in range(5000) for x in model.sample_group(rng, 8)]
    median = statistics.median(xs)
    assert median == pytest.approx(100, rel=0.05)
    assert quantile(xs, 0.99) / median == pytest.approx(math.exp(2.326 * 0.99), rel=0.12)


def test_the_cap_holds_and_carries_the_tail_mass():
    model = LengthModel(median=256, sigma=0.99, cap=1024, group_corr=0.5)
    rng = random.Random(2)
    xs = [x for _ in range(2000) for x in model.sample_group(rng, 8)]
    assert max(xs) == 1024 and min(xs) >= 1
    at_cap = sum(x == 1024 for x in xs) / len(xs)
    # P(z > ln(4) / 0.99) = P(z > 1.40) ~ 0.08
    assert 0.05 < at_cap < 0.11


def test_samples_of_a_group_are_correlated():
    def within_over_total(corr: float) -> float:
        model = LengthModel(median=256, sigma=1.0, cap=10**9, group_corr=corr)
        rng = random.Random(3)
        groups = [[math.log(x) for x in model.sample_group(rng, 8)] for _ in range(2000)]
        within = statistics.mean(statistics.pvariance(g) for g in groups)
        total = statistics.pvariance([x for g in groups for x in g])
        return within / total

    # within-group variance is the unshared share: (1 - corr) * 7/8 of the total (n = 8)
    assert within_over_total(0.0) == pytest.approx(7 / 8, abs=0.05)
    assert within_over_total(0.5) == pytest.approx(0.5 * 7 / 8, abs=0.05)
    assert within_over_total(1.0) < 0.01


def test_the_median_grows_with_the_policy_version():
    model = LengthModel(median=100, sigma=0.5, cap=10**9, growth_per_step=0.1, group_corr=0.0)
    rng = random.Random(4)
    late = [x for _ in range(2000) for x in model.sample_group(rng, 4, version=10)]
    assert statistics.median(late) == pytest.approx(100 * 1.1**10, rel=0.05)


def test_a_seed_fixes_the_lengths():
    model = LengthModel()
    assert model.sample_group(random.Random(7), 16) == model.sample_group(random.Random(7), 16)


def test_costs():
    assert EngineCost(a_s=0.02, b_s=0.001).iteration_s(10) == pytest.approx(0.03)
    assert EngineCost(prefill_s_per_token=1e-4).prefill_s(100) == pytest.approx(0.01)
    assert TrainerCost(a_s=1, s_per_token=1e-3).step_s(1000) == pytest.approx(2.0)
    assert TrainerCost(a_s=1, s_per_token=1e-3).step_s(1000, devices=4) == pytest.approx(1.25)
    assert AgentModel().latency_s(random.Random(0)) == 0.0
    rng = random.Random(5)
    lat = [AgentModel(turns=3, env_latency_s=2.0).latency_s(rng) for _ in range(20000)]
    assert statistics.mean(lat) == pytest.approx(2.0, rel=0.03)
    assert AgentModel(env_latency_s=2.0).start_s(rng) == 0.0
    starts = [AgentModel(start_latency_s=0.5).start_s(rng) for _ in range(20000)]
    assert statistics.mean(starts) == pytest.approx(0.5, rel=0.03)


def test_round_trip_through_a_dict():
    w = Workload(
        lengths=LengthModel(median=300, sigma=1.2, cap=4096, group_corr=0.3, growth_per_step=0.01),
        engine=EngineCost(a_s=0.03, max_batch=128),
        trainer=TrainerCost(a_s=2.0),
        agent=AgentModel(turns=4, env_latency_s=1.5),
        switch=SwitchCost(warm_s=0.5, reprefill=False),
        weight_sync_s=3.0,
        group_size=16,
        groups_per_step=8,
        seed=9,
    )
    assert Workload.from_dict(w.to_dict()) == w
    assert Workload.from_dict({}) == Workload()
    assert Workload.from_dict({"engine": {"max_batch": 8}}).engine == EngineCost(max_batch=8)


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match="groups_per_stpe"):
        Workload.from_dict({"groups_per_stpe": 4})
    with pytest.raises(ValueError, match=r"lengths\.sigmaa"):
        Workload.from_dict({"lengths": {"sigmaa": 1.0}})
    with pytest.raises(ValueError, match="engine must be a mapping"):
        Workload.from_dict({"engine": 3})


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="group_corr"):
        LengthModel(group_corr=1.5)
    with pytest.raises(ValueError, match="max_batch"):
        Workload.from_dict({"engine": {"max_batch": 0}})
    with pytest.raises(ValueError, match="start_latency_s"):
        Workload.from_dict({"agent": {"start_latency_s": -1}})


def test_phases_replace_the_agent_and_lengths_from_their_step_on():
    agentic = Phase(from_step=3, agent=AgentModel(turns=4, env_latency_s=8.0))
    single = Phase(from_step=6, lengths=LengthModel(median=1024))
    w = Workload(lengths=LengthModel(median=128), phases=(agentic, single))
    assert w.at(0) == Workload(lengths=LengthModel(median=128))
    assert w.at(2) == w.at(0)
    assert (w.at(3).agent, w.at(5).agent) == (agentic.agent, agentic.agent)
    assert w.at(3).lengths == LengthModel()
    assert w.at(6).agent == AgentModel() and w.at(99).lengths.median == 1024
    assert w.at(4).phases == ()


def test_phases_and_the_kv_budget_round_trip_through_json():
    w = Workload(
        engine=EngineCost(max_batch=64, kv_tokens=16384),
        phases=(Phase(from_step=2, agent=AgentModel(turns=3), lengths=LengthModel(cap=512)),),
    )
    assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    with pytest.raises(ValueError, match=r"phases\[0\]\.agent\.turnz"):
        Workload.from_dict({"phases": [{"agent": {"turnz": 2}}]})
    with pytest.raises(ValueError, match="phases must be a list"):
        Workload.from_dict({"phases": {"from_step": 1}})


def test_bad_phases_and_kv_budgets_are_refused():
    with pytest.raises(ValueError, match="increasing from_step"):
        Workload(phases=(Phase(from_step=4), Phase(from_step=2)))
    with pytest.raises(ValueError, match="increasing from_step"):
        Workload(phases=(Phase(from_step=2), Phase(from_step=2)))
    with pytest.raises(ValueError, match="from_step"):
        Phase(from_step=-1)
    with pytest.raises(ValueError, match="kv_tokens"):
        Workload.from_dict({"engine": {"kv_tokens": -1}})
