"""The trainer's pure core: advantages, the decoupled clipped loss, KL, mismatch, staleness,
batching of complete groups, and a short learning check on the tiny model."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.messages import SampleReady
from common.staleness import StalenessMode
from trainer.backends.base import TokenBatch, logprobs_from_logits
from trainer.batcher import Batcher, Outcome, lag, plan_step
from trainer.config import Advantage, TrainerConfig
from trainer.exceptions import BatchError
from trainer.losses import group_advantages, k3, mismatch, policy_loss
from trainer.order import AdmissionOrder


def sample(
    sid: str,
    group: str = "g",
    session: str | None = None,
    *,
    reward: float = 0.0,
    versions: tuple[int, ...] = (0, 0),
    group_size: int = 1,
    session_samples: int = 1,
    prompt: tuple[int, ...] = (1, 2),
    completion: tuple[int, ...] | None = None,
) -> SampleReady:
    out = list(completion) if completion is not None else [3] * len(versions)
    out_versions = (list(versions) * len(out))[: len(out)]
    return SampleReady(
        sample_id=sid,
        session_id=session or sid,
        group_id=group,
        token_ids=list(prompt) + out,
        loss_mask=[0] * len(prompt) + [1] * len(out),
        logprobs=[0.0] * len(prompt) + [-1.0] * len(out),
        versions=[-1] * len(prompt) + out_versions,
        reward=reward,
        on_policy=True,
        group_size=group_size,
        session_samples=session_samples,
    )


# -- advantages ---------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=2, max_size=16))
def test_grpo_advantages_are_standardised_within_a_group(rewards):
    adv = group_advantages(rewards, Advantage.GRPO, 1e-6)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    for a, r in zip(adv, rewards, strict=True):
        assert a == pytest.approx((r - mean) / (std + 1e-6), abs=1e-9)
    assert sum(adv) == pytest.approx(0, abs=1e-6)


def test_baseline_advantages_only_subtract_the_mean():
    assert group_advantages([1.0, 0.0, 0.0, 3.0], Advantage.BASELINE, 1e-6) == [0, -1, -1, 2]
    assert group_advantages([2.0, 2.0], Advantage.GRPO, 1e-6) == [0, 0]  # no signal, no blow-up


def test_each_group_gets_its_own_advantages_and_all_tokens_share_them():
    config = TrainerConfig(advantage=Advantage.BASELINE, max_staleness=10)
    groups = [
        [sample("a1", "a", reward=1.0, group_size=2), sample("a2", "a", reward=0.0, group_size=2)],
        [sample("b1", "b", reward=5.0, group_size=2), sample("b2", "b", reward=3.0, group_size=2)],
    ]
    items, outcomes, _ = plan_step(groups, 0, config)
    assert [i.advantage for i in items] == [0.5, -0.5, 1.0, -1.0]
    assert set(outcomes.values()) == {Outcome.TRAINED}


# -- the policy loss ----------------------------------------------------------------------------
def _loss(logp, prox, behav, adv, **kw):
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    options = dict(clip_low=0.2, clip_high=0.3, importance_cap=2.0, total_tokens=len(logp))
    options.update(kw)
    logp = t(logp).requires_grad_(True)
    terms = policy_loss(
        logp,
        t(prox),
        t(behav),
        torch.tensor([[adv]], dtype=torch.float64),
        torch.ones(1, logp.shape[1]),
        torch.ones(1, 1),
        **options,
    )
    terms.loss.backward()
    return terms, logp.grad[0]


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_clipping_bites_only_outside_the_band(adv):
    prox = [0.0] * 4
    ratios = [0.7, 0.9, 1.2, 1.5]  # below, inside, inside, above the band [0.8, 1.3]
    terms, grad = _loss([math.log(r) for r in ratios], prox, prox, adv)
    assert terms.clipped_tokens == 2
    # Inside the band the gradient of -r*A/n w.r.t. logp is -r*A/n; outside, the clipped side
    # has no gradient when it is the smaller objective (A>0 above, A<0 below).
    for r, g in zip(ratios, grad.tolist(), strict=True):
        inside = 0.8 <= r <= 1.3
        bites = (adv > 0 and r > 1.3) or (adv < 0 and r < 0.8)
        expected = 0.0 if bites else -r * adv / 4
        assert g == pytest.approx(expected, abs=1e-12), (r, inside)


def test_importance_weight_is_truncated_at_the_cap():
    # exp(prox - behav) = e^2 ~ 7.4 is capped at 2; e^0.5 ~ 1.65 is not.
    terms, grad = _loss([0.0, 0.0], [0.0, 0.0], [-2.0, -0.5], 1.0, importance_cap=2.0)
    assert terms.capped_tokens == 1
    assert grad.tolist() == pytest.approx([-2.0 / 2, -math.exp(0.5) / 2])


def test_aggregation_is_token_level_over_the_global_count():
    # Two samples of 1 and 3 tokens: each token weighs 1/total, not 1/2 per sample.
    logp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    weights = torch.tensor([[1.0], [0.5]])
    for total in (4, 8):  # 8: as if another rank held 4 more tokens
        terms = policy_loss(
            logp, logp, logp, adv, mask, weights,
            clip_low=0.2, clip_high=0.2, importance_cap=5.0, total_tokens=total,
        )  # fmt: skip
        assert float(terms.loss) == pytest.approx(-(1 + 3 * 0.5) / total)


def test_kl_is_zero_when_equal_and_positive_otherwise():
    a = torch.log_softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.allclose(k3(a, a), torch.zeros_like(a))
    b = a.roll(1, dims=-1)
    assert bool((k3(a, b) >= 0).all()) and float(k3(a, b).sum()) > 0
    same = [0.1, -0.2]
    reference = torch.tensor([same], dtype=torch.float64)
    terms, _ = _loss(same, same, same, 1.0, reference=reference, kl_coef=1.0)
    assert terms.kl == pytest.approx(0.0)


def test_mismatch_counts_only_same_version_tokens():
    behav = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    prox = torch.tensor([-1.5, -2.0, -1.0, -9.0])
    same = torch.tensor([True, True, False, False])
    m = mismatch(behav, prox, same)
    assert (m.tokens, m.mean_abs, m.max_abs) == (2, 0.25, 0.5)
    assert m.kl > 0
    assert mismatch(behav, prox, torch.zeros(4, dtype=torch.bool)).tokens == 0


# -- staleness ----------------------------------------------------------------------------------
def test_lag_is_measured_from_the_oldest_loss_token():
    assert lag(sample("s", versions=(3, 5)), 7) == 4
    assert lag(sample("s", versions=(7, 7)), 7) == 0


@pytest.mark.parametrize("mode", list(StalenessMode))
def test_staleness_bound_drops_or_downweights(mode):
    config = TrainerConfig(max_staleness=2, staleness_mode=mode, stale_weight=0.25)
    group = [
        sample("fresh", reward=1.0, versions=(4, 5), group_size=2),
        sample("old", reward=0.0, versions=(2, 5), group_size=2),
    ]
    items, outcomes, lags = plan_step([group], 5, config)
    assert lags == [1, 3]
    assert outcomes["fresh"] is Outcome.TRAINED
    if mode is StalenessMode.DROP:
        assert outcomes["old"] is Outcome.STALE_DROPPED
        assert [i.sample.sample_id for i in items] == ["fresh"]
    else:
        assert outcomes["old"] is Outcome.DOWNWEIGHTED
        assert [(i.sample.sample_id, i.weight) for i in items] == [("fresh", 1.0), ("old", 0.25)]
    # The advantage still comes from the whole group.
    assert items[0].advantage > 0


def test_logprobs_are_read_at_the_sampling_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    batch = TokenBatch(ids, torch.arange(5).expand(2, -1), torch.ones_like(ids))
    for temperature in (1.0, 0.7):
        got = logprobs_from_logits(logits, batch, temperature)
        want = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None])
        assert torch.allclose(got[:, 1:], want[..., 0], atol=1e-6) and (got[:, 0] == 0).all()
    assert not torch.allclose(
        logprobs_from_logits(logits, batch, 1.0), logprobs_from_logits(logits, batch, 0.7)
    )


# -- batching -----------------------------------------------------------------------------------
def test_a_group_completes_with_all_sessions_and_all_their_samples():
    b = Batcher(AdmissionOrder(60.0))
    b.add(sample("x1", "g", "s1", group_size=2, session_samples=2))
    b.add(sample("y1", "g", "s2", group_size=2, session_samples=1))
    assert b.take(1) is None  # s1 still misses a sample
    b.add(sample("x2", "g", "s1", group_size=2, session_samples=2))
    groups = b.take(1)
    assert groups is not None and sorted(s.sample_id for s in groups[0]) == ["x1", "x2", "y1"]
    assert not b.holds("x1")


def test_groups_with_the_oldest_tokens_leave_first_and_steps_wait_for_enough():
    b = Batcher(AdmissionOrder(60.0))
    b.add(sample("a1", "a", group_size=2, versions=(3, 3)))
    b.add(sample("b1", "b", group_size=1, versions=(3, 3)))
    b.add(sample("c1", "c", group_size=1, versions=(2, 4)))
    b.add(sample("a2", "a", group_size=2, versions=(3, 3)))
    assert b.take(4) is None
    # c's oldest token is the oldest; b and a are equals, in the order they completed
    assert [g[0].group_id for g in b.take(2)] == ["c", "b"]
    assert [g[0].group_id for g in b.take(1)] == ["a"]


def test_contradicting_samples_are_refused_with_a_reason():
    b = Batcher(AdmissionOrder(60.0))
    b.add(sample("a1", "a", "s1", group_size=2))
    with pytest.raises(BatchError, match="already held"):
        b.add(sample("a1", "a", "s1", group_size=2))
    with pytest.raises(BatchError, match="group_size 3"):
        b.add(sample("a2", "a", "s2", group_size=3))
    with pytest.raises(BatchError, match="already has"):
        b.add(sample("a3", "a", "s1", group_size=2))
    b.add(sample("a4", "a", "s2", group_size=2))
    with pytest.raises(BatchError, match="is complete"):
        b.add(sample("a5", "a", "s3", group_size=2))


def test_a_group_missing_a_session_is_closed_after_the_timeout():
    b = Batcher(AdmissionOrder(60.0))
    b.add(sample("a1", "a", "s1", group_size=3))
    b.add(sample("a2", "a", "s2", group_size=3))  # the third session ended without samples
    assert b.expire(60.0) == 0 and b.take(1) is None
    assert b.expire(0.0) == 1
    (group,) = b.take(1)
    assert sorted(s.sample_id for s in group) == ["a1", "a2"]


def test_advantages_count_each_session_once_however_many_leaves_it_has():
    group = [sample("a", "g", "s1", reward=1.0, group_size=2)] + [
        sample(f"b{i}", "g", "s2", reward=0.0, group_size=2, session_samples=3) for i in range(3)
    ]
    items, _, _ = plan_step([group], 0, TrainerConfig())
    by_session = {i.sample.session_id: i.advantage for i in items}
    assert by_session["s1"] == pytest.approx(-by_session["s2"])  # mean 0.5 over 2 sessions
    assert by_session["s1"] > 0


# -- learning -----------------------------------------------------------------------------------
def test_grpo_steps_raise_the_rewarded_completion(tiny_model_dir):
    from trainer.backends import build_backend
    from trainer.batcher import collate
    from trainer.step import train_step

    config = TrainerConfig(lr=1e-3, groups_per_step=1, max_staleness=100)
    backend = build_backend(tiny_model_dir, config)
    prompt = (5, 6, 7)
    good, bad = (40, 41, 42), (50, 51, 52)

    def logprob_of(completion) -> float:
        items, _, _ = plan_step([[sample("p", prompt=prompt, completion=completion)]], 0, config)
        lp = backend.token_logprobs(collate(items, backend.row_tokens).tokens, grad=False)
        return float(lp[0, len(prompt) :].sum())

    def group(version: int) -> list[SampleReady]:
        rows = [(good, 1.0), (bad, 0.0), (bad, 0.0), (good, 1.0)]
        return [
            sample(f"s{version}-{i}", "g", reward=r, prompt=prompt, completion=c, group_size=4)
            for i, (c, r) in enumerate(rows)
        ]

    before_good, before_bad = logprob_of(good), logprob_of(bad)
    for version in range(4):
        items, _, _ = plan_step([group(version)], version, config)
        train_step(backend, items, version, config)
    assert logprob_of(good) > before_good + 1.0
    assert logprob_of(bad) < before_bad
