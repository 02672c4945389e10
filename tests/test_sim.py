"""The cluster simulator (emulation.sim): invariants of every arm and the lending policy's
behaviour at the two ends of the switch-cost range. Small clusters, a few seconds in all."""

from dataclasses import replace

import pytest

from common.staleness import StalenessMode
from emulation.sim import ARMS, Arm, best_split, simulate
from emulation.workload import (
    AgentModel,
    EngineCost,
    LengthModel,
    SwitchCost,
    TrainerCost,
    Workload,
)


def agentic(switch_s: float = 0.5, seed: int = 0) -> Workload:
    """Long-tailed multi-turn lengths; 16 groups of 8 per step; rollout costs about three
    times training per token."""
    return Workload(
        lengths=LengthModel(median=128, sigma=0.99, cap=1024, group_corr=0.5),
        engine=EngineCost(a_s=0.02, b_s=0.0005, max_batch=16),
        trainer=TrainerCost(a_s=1.0, s_per_token=6e-4),
        agent=AgentModel(turns=2, env_latency_s=1.0),
        switch=SwitchCost(warm_s=switch_s),
        weight_sync_s=1.0,
        group_size=8,
        groups_per_step=16,
        seed=seed,
    )


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("staleness", [0, 2])
def test_every_arm_trains_what_was_asked_within_the_bound(arm, staleness):
    w = agentic()
    r = simulate(w, arm, 16, 8, staleness, 4)
    assert r.trained_samples == 8 * w.samples_per_step
    assert r.staleness_max <= (0 if arm == Arm.SYNC_COLOCATED else staleness)
    assert all(0.0 <= v <= 1.0 for v in r.idle.values())
    assert 0.0 <= r.aborted_token_fraction < 1.0
    assert r.time_s > 0 and r.tokens_per_s > 0
    if arm == Arm.SYNC_COLOCATED:
        assert (r.trainer_devices, r.length_bias, r.dropped_groups) == (16, 1.0, 0)


def test_the_same_seed_gives_the_same_run():
    a = simulate(agentic(seed=3), "multiplexed", 16, 6, 1, 4).to_dict()
    b = simulate(agentic(seed=3), "multiplexed", 16, 6, 1, 4).to_dict()
    c = simulate(agentic(seed=4), "multiplexed", 16, 6, 1, 4).to_dict()
    for d in (a, b, c):
        d.pop("wall_s")
    assert a == b
    assert a != c


def test_lending_turns_itself_off_when_a_switch_costs_more_than_the_idle_window():
    w = agentic(switch_s=100.0)
    static = simulate(w, "partial_rollout", 16, 20, 2, 4)
    lending = simulate(w, "multiplexed", 16, 20, 2, 4)
    assert static.trainer_wait_s_mean < 100.0
    # Only the start-up lend (nothing measured yet: the wait looks endless), then never again.
    assert lending.lends <= 4
    ratio = lending.steady_samples_per_s / static.steady_samples_per_s
    assert ratio == pytest.approx(1.0, abs=0.03)


def test_multiplexing_beats_the_best_static_split_when_rollout_is_scarce_and_switching_cheap():
    w = agentic(switch_s=0.5)
    static = simulate(w, "partial_rollout", 16, 12, 2)  # the best static split, swept
    lending = simulate(w, "multiplexed", 16, 12, 2)  # its own best split
    assert lending.lends > 0
    assert static.time_s / lending.time_s > 1.05
    assert lending.idle["train"] < static.idle["train"]
    assert best_split(w, 16, 12, 2, arm=Arm.MULTIPLEXED) >= best_split(w, 16, 12, 2)


def test_aborts_without_a_reprefill_throw_tokens_away():
    w = agentic(switch_s=0.5)
    kept = simulate(w, "multiplexed", 16, 8, 2, 6)
    lost = simulate(
        replace(w, switch=SwitchCost(warm_s=0.5, reprefill=False)), "multiplexed", 16, 8, 2, 6
    )
    assert kept.reclaims > 0 and kept.reprefill_token_fraction > 0
    assert lost.reprefill_token_fraction == 0
    assert lost.aborted_token_fraction > kept.aborted_token_fraction


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="needs a device for rollout"):
        simulate(agentic(), "disaggregated", 8, 2, 1, 8)
    with pytest.raises(ValueError, match="not a valid Arm"):
        simulate(agentic(), "fancy", 8, 2, 1, 2)


def test_downweight_mode_trains_stale_groups_instead_of_dropping_them():
    w = agentic()
    dropped = simulate(w, "partial_rollout", 16, 10, 1, 4)
    kept = simulate(w, "partial_rollout", 16, 10, 1, 4, stale=StalenessMode.DOWNWEIGHT)
    assert dropped.dropped_groups > 0 and dropped.staleness_max <= 1
    assert kept.dropped_groups == 0 and kept.staleness_max >= 2
    assert kept.aborted_token_fraction < dropped.aborted_token_fraction
