"""Workloads whose rollout/train balance moves during a run, in the cluster simulator: response
lengths that grow over the run, and the KV budget that turns longer responses into smaller
decode batches (what moves the balance). Small clusters, well under a second in all."""

from dataclasses import replace

import pytest

from common.staleness import StalenessMode
from emulation.sim import Arm, Cluster, simulate
from emulation.workload import AgentModel, EngineCost, LengthModel, Phase, TrainerCost, Workload


def workload(
    median: float = 128, growth: float = 0.0, kv_tokens: int = 0, seed: int = 0
) -> Workload:
    return Workload(
        lengths=LengthModel(median=median, sigma=0.5, cap=4096, growth_per_step=growth),
        engine=EngineCost(max_batch=32, kv_tokens=kv_tokens),
        trainer=TrainerCost(a_s=1.0, s_per_token=3e-4),
        group_size=8,
        groups_per_step=16,
        seed=seed,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_tokens_per_step_grow_about_4x_over_a_growing_run(seed):
    steps = 12
    w = workload(growth=4 ** (1 / (steps - 1)) - 1, seed=seed)
    c = Cluster(
        w,
        Arm.PARTIAL_ROLLOUT,
        devices=8,
        trainer_devices=2,
        steps=steps,
        staleness=1,
        stale=StalenessMode.DOWNWEIGHT,  # every step trains a step's samples: none dropped
    )
    c.run()
    tokens = c.m.step_tokens
    # the last two steps train samples drawn about 9.5 versions after the first two's
    assert 3.0 < sum(tokens[-2:]) / sum(tokens[:2]) < 4.6
    flat = Cluster(
        workload(seed=seed),
        Arm.PARTIAL_ROLLOUT,
        devices=8,
        trainer_devices=2,
        steps=steps,
        staleness=1,
        stale=StalenessMode.DOWNWEIGHT,
    )
    flat.run()
    same = flat.m.step_tokens
    assert 0.7 < sum(same[-2:]) / sum(same[:2]) < 1.4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_kv_budget_makes_longer_generations_decode_in_smaller_batches(seed):
    def batch(median: float, kv_tokens: int) -> float:
        w = workload(median=median, kv_tokens=kv_tokens, seed=seed)
        return simulate(w, "partial_rollout", 4, 4, 2, 1).mean_batch

    # without a budget the engines stay full (32) whatever the lengths
    assert batch(128, 0) > 30 and batch(512, 0) > 30
    # 5120 tokens hold about 32 generations of median 128 (mean 145), about 9 of median 512
    assert batch(128, 5120) > 25
    assert batch(512, 5120) < 0.35 * batch(128, 5120)


def test_groups_follow_the_phase_of_the_version_they_are_admitted_at():
    # From step 2 on, episodes take 3 turns 30 s apart: the steps before it are quick, the ones
    # after it each wait out the environment (a simulator that ignored the phase would keep
    # every step quick).
    agentic = Phase(from_step=2, agent=AgentModel(turns=3, env_latency_s=30.0))
    w = replace(workload(), groups_per_step=2, phases=(agentic,))
    c = Cluster(w, Arm.PARTIAL_ROLLOUT, devices=4, trainer_devices=1, steps=6, staleness=0)
    c.run()
    gaps = [b - a for a, b in zip((0.0, *c.m.step_ends), c.m.step_ends, strict=False)]
    assert max(gaps[:2]) < 30
    assert min(gaps[3:]) > 60
