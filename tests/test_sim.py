"""The cluster simulator (emulation.sim): invariants of every arm and the lending policy's
behaviour at the two ends of the switch-cost range. Small clusters, a few seconds in all."""

import random
from dataclasses import replace

import pytest

from common.staleness import StalenessMode
from emulation.sim import ARMS, Arm, Order, Rhythm, best_split, simulate
from emulation.sim.cluster import Cluster
from emulation.sim.order import Batches, _Group, _Sample
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
@pytest.mark.parametrize("order", Order)
def test_every_arm_trains_what_was_asked_within_the_bound(arm, staleness, order):
    w = agentic()
    r = simulate(w, arm, 16, 8, staleness, 4, order=order)
    # drop mode: a step's stale samples are dropped, the rest of their groups trained
    assert r.trained_samples <= 8 * w.samples_per_step <= r.trained_samples + r.dropped_samples
    assert r.staleness_max <= (0 if arm == Arm.SYNC_COLOCATED else staleness)
    assert all(0.0 <= v <= 1.0 for v in r.idle.values())
    assert 0.0 <= r.aborted_token_fraction < 1.0
    assert r.time_s > 0 and r.tokens_per_s > 0
    if arm == Arm.SYNC_COLOCATED:
        assert (r.trainer_devices, r.length_bias, r.dropped_groups) == (16, 1.0, 0)
        assert r.order == Order.COMPLETION  # synchronous: nothing to order
    else:
        assert r.order == order


def test_a_colocated_layout_pays_its_switches_and_no_more():
    """``colocated``, the real layout: every device trains and is lent to rollout while the
    batch is incomplete (a step ahead admitted, interrupted at the reclaim). Groups come fast
    here, so with 0.5 s switches the lending gates would reclaim ahead of the batch and then
    wait, nobody generating, for the rate to fall (9.9 s a step against 3.2); now a step pays
    its lend and its reclaim."""

    def quick(switch_s: float) -> Workload:
        return Workload(
            lengths=LengthModel(median=4, sigma=0.3, cap=8),
            engine=EngineCost(a_s=0.02, b_s=0.003, max_batch=64),
            trainer=TrainerCost(a_s=0.1, s_per_token=0.002),
            agent=AgentModel(turns=2, env_latency_s=0.05),
            switch=SwitchCost(warm_s=switch_s),
            weight_sync_s=0.05,
            group_size=8,
            groups_per_step=8,
        )

    for devices in (1, 2):
        fast, slow = (
            simulate(quick(s), Arm.COLOCATED, devices, 20, 1, devices) for s in (0.01, 0.5)
        )
        assert fast.trainer_devices == devices
        assert fast.trained_samples + fast.dropped_samples == 20 * 64  # a stale sample dropped
        assert fast.lends >= 19 and fast.staleness_max <= 1  # lent for nearly every step
        assert slow.time_s / 20 < fast.time_s / 20 + 4 * 0.5


def test_a_start_latency_delays_first_generations_and_sync_steps_hide_it():
    """Tasks take time to reach their first call (``AgentModel.start_latency_s``, fitted by
    ``seamlessflow plan`` from a run; drawn from its own random stream, so the lengths are the
    same with or without it). The asynchronous arm makes fewer samples a second; synchronous
    colocated steps (about 33 s here) take their tasks a step ahead, so a shorter latency
    delays the first step only and a longer one every step."""
    base = agentic()

    def late(latency_s: float) -> Workload:
        return replace(base, agent=replace(base.agent, start_latency_s=latency_s))

    partial = [
        simulate(w, Arm.PARTIAL_ROLLOUT, 16, 6, 1, 8, stale=StalenessMode.DOWNWEIGHT)
        for w in (base, late(20.0))
    ]
    assert partial[1].samples_per_s < 0.75 * partial[0].samples_per_s
    assert partial[1].trained_samples == partial[0].trained_samples

    def added_s(latency_s: float, steps: int) -> float:
        sync = [simulate(w, Arm.SYNC_COLOCATED, 16, steps, 0) for w in (base, late(latency_s))]
        return sync[1].time_s - sync[0].time_s

    assert added_s(3.0, 3) > 3.0  # the first step waits for the slowest of its samples
    assert added_s(3.0, 6) == pytest.approx(added_s(3.0, 3))  # and no later one
    assert added_s(20.0, 6) > added_s(20.0, 3) + 5.0  # longer than a step: every step waits


def test_verls_rhythm_syncs_every_k_steps_within_its_budget():
    """``Rhythm`` (verl's fully-async rollouter, to compare with its published gains): weights
    reach the engines every ``sync_every`` steps, so a window's samples lag the trainer by up to
    ``sync_every - 1`` and no more while the budget holds the rollouter to one window; a
    budget above one window lets samples of the next window be generated on old weights."""
    w, steps = agentic(), 8

    def run(arm: Arm, rhythm: Rhythm):
        return simulate(w, arm, 16, steps, 8, 8, stale=StalenessMode.DOWNWEIGHT, rhythm=rhythm)

    every_step = run(Arm.DISAGGREGATED, Rhythm(sync_every=1))
    assert every_step.staleness_max == 0  # one step's groups at a time: synchronous
    windows = run(Arm.DISAGGREGATED, Rhythm(sync_every=4))
    assert windows.staleness_max == 3 and windows.staleness_mean > 0.5
    ahead = run(Arm.PARTIAL_ROLLOUT, Rhythm(sync_every=4, staleness=0.5))
    assert ahead.staleness_max > 3
    for r in (every_step, windows, ahead):
        assert r.trained_samples == steps * w.samples_per_step
    with pytest.raises(ValueError, match="disaggregated arms"):
        simulate(w, Arm.MULTIPLEXED, 16, steps, 1, 8, rhythm=Rhythm(sync_every=2))
    with pytest.raises(ValueError, match="sync_every"):
        Rhythm(sync_every=0)


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


@pytest.mark.parametrize("order", Order)
def test_a_stale_sample_is_dropped_from_its_group_as_the_trainer_drops_it(order):
    """Drop mode, the real trainer's rule (``trainer.batcher.plan_step``): a sample whose oldest
    token lags past the bound is dropped; the rest of its group trains. A step taken whole
    counts the group whatever it dropped; ``overlap`` gives a group dropped whole no place."""
    batches = Batches(
        order, groups_per_step=2, staleness=1, stale=StalenessMode.DROP, order_wait_s=0
    )
    fresh, mixed, gone = (_Group(gid) for gid in range(3))
    for group, versions in ((fresh, [3, 3]), (mixed, [1, 3]), (gone, [0, 1])):
        group.samples = [_Sample(group, [10], tokens=10 + v, versions=[v]) for v in versions]
        group.done = 2
    for group in (gone, mixed, fresh):
        batches.completed(group)
    taken, tokens = batches.take(3)
    trained = {g.gid: [s.versions[0] for s in g.samples] for g in taken}
    if order is Order.OVERLAP:  # ``gone`` took no place
        assert trained == {mixed.gid: [3], fresh.gid: [3, 3]}
    else:  # oldest first (completion: as completed): ``gone`` and ``mixed``, and nothing else
        assert trained == {gone.gid: [], mixed.gid: [3]}
    assert tokens == sum(s.tokens for g in taken for s in g.samples)
    assert (batches.dropped, batches.dropped_samples, batches.dropped_tokens) == (
        1,
        3,
        10 + 11 + 11,
    )
    assert len(batches) == (0 if order is Order.OVERLAP else 1)  # ``fresh`` waits for its step


def test_downweight_mode_trains_stale_groups_instead_of_dropping_them():
    w = agentic()
    dropped = simulate(w, "partial_rollout", 16, 10, 1, 4)
    kept = simulate(w, "partial_rollout", 16, 10, 1, 4, stale=StalenessMode.DOWNWEIGHT)
    assert dropped.dropped_groups > 0 and dropped.staleness_max <= 1
    assert kept.dropped_groups == 0 and kept.staleness_max >= 2
    assert kept.aborted_token_fraction < dropped.aborted_token_fraction


def test_in_drop_mode_overlapping_the_order_wait_trains_long_groups_at_no_loss_of_throughput():
    """Issue 22, item 1. Trained in the order they complete, groups that outlast the staleness
    bound are dropped, and those are the long ones: the trainer sees shorter samples than were
    drawn. Admission order (the real trainer) keeps them, but its steps wait for them. Computing
    the complete groups while the step waits keeps them at completion order's throughput."""
    w = agentic()
    runs = {
        order: simulate(w, "partial_rollout", 16, 24, 1, 3, order=order, order_wait_s=20.0)
        for order in Order
    }
    before, real, overlap = runs[Order.COMPLETION], runs[Order.ADMISSION], runs[Order.OVERLAP]
    assert before.length_bias < 0.95 and before.aborted_token_fraction > 0.1
    for r in (real, overlap):
        assert r.length_bias >= 0.98 and r.aborted_token_fraction < 0.03
        assert r.staleness_max <= 1 and r.trained_samples > before.trained_samples
        assert r.order_wait_s_per_step > 0
    assert before.order_wait_s_per_step == 0
    assert real.samples_per_s < 0.95 * before.samples_per_s
    assert overlap.samples_per_s >= before.samples_per_s


def test_a_multiplexed_trainer_waiting_for_an_earlier_ticket_is_lent_not_idle():
    """Admission order in drop mode: a step whose groups are complete still waits for an
    earlier admitted task it would put past the bound. The real trainer tells the scheduler how
    many it waits for (``order_waiting``) and the lending gate counts them missing, so its
    workers serve rollout meanwhile; the simulator's gate saw none missing and left them idle
    (4.4-5.5 s of order wait a step, as much as the static split's)."""
    w = agentic(switch_s=0.1)
    runs = {
        arm: simulate(w, arm, 16, 24, 1, 3, order=Order.ADMISSION, order_wait_s=20.0)
        for arm in ("partial_rollout", "multiplexed")
    }
    static, lending = runs["partial_rollout"], runs["multiplexed"]
    assert static.order_wait_s_per_step > 3.0  # the wait is there to be lent
    assert lending.lends > 0 and lending.order_wait_s_per_step < 0.5
    assert lending.idle["train"] < 0.5 * static.idle["train"]
    assert lending.staleness_max <= 1 and lending.trained_samples == static.trained_samples


def test_every_arm_draws_a_groups_lengths_from_its_admission_number_as_the_emulated_agent_does():
    """Common random numbers: the simulator draws the ``g``-th admitted group's lengths for a
    turn from ``Workload.draw_seed(g, turn)``, whatever the arm, split and timing; the emulated
    engine draws a request seeded ``draw_seed(g, turn) * group_size + member`` from
    ``random.Random(seed // group_size)`` (``tests/test_emulated.py`` checks that rule), which
    is what the benchmark agent sends. So two arms compare on one realization of the workload,
    and the emulated cluster runs that realization too. Before, one generator drew lengths and
    environment latencies in event order, so each arm saw other lengths for the same group."""
    w = agentic()
    trained: dict[Arm, dict[int, list[list[int]]]] = {}
    for arm, trainer_devices, staleness in (
        (Arm.PARTIAL_ROLLOUT, 4, 1),
        (Arm.SYNC_COLOCATED, 16, 0),
    ):
        cluster = Cluster(
            w, arm, devices=16, trainer_devices=trainer_devices, steps=4, staleness=staleness
        )
        take, groups = cluster.batches.take, trained.setdefault(arm, {})

        def spied(version: int, take=take, groups=groups):  # a spy: records, changes nothing
            taken = take(version)
            for group in taken[0] if taken else []:
                if len(group.samples) == w.group_size:  # none dropped as stale
                    groups[group.gid] = [sample.lengths for sample in group.samples]
            return taken

        cluster.batches.take = spied
        cluster.run()
    common = trained[Arm.PARTIAL_ROLLOUT].keys() & trained[Arm.SYNC_COLOCATED].keys()
    assert len(common) >= 2 * w.groups_per_step
    for gid in common:
        per_turn = [
            w.lengths.sample_group(random.Random(w.draw_seed(gid, turn)), w.group_size)
            for turn in range(w.agent.turns)
        ]
        emulated = [[turn[member] for turn in per_turn] for member in range(w.group_size)]
        assert trained[Arm.PARTIAL_ROLLOUT][gid] == trained[Arm.SYNC_COLOCATED][gid] == emulated
