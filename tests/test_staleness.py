"""One staleness rule (``common.staleness``): a sample's lag is the trainer's version minus the
oldest version among its loss tokens; the trainer's batcher, the run's progress line and the
simulator all count it so."""

from broker.messages import SampleReady, WeightsPublished
from common.staleness import lag
from emulation.sim.cluster import _Group, _Sample
from seamlessflow.progress import RunStats
from trainer.batcher import lag as batcher_lag

PROMPT_VERSIONS = [1, 1, 1]
"""Versions of the prompt tokens (not loss tokens): older than every generated one."""
GENERATED_VERSIONS = [5, 3, 6]
"""Versions of the generated (loss) tokens, the oldest not first."""
TRAINER_VERSION = 7


def test_the_oldest_loss_token_counts_and_prompt_tokens_do_not():
    versions = PROMPT_VERSIONS + GENERATED_VERSIONS
    mask = [0] * len(PROMPT_VERSIONS) + [1] * len(GENERATED_VERSIONS)
    assert lag(TRAINER_VERSION, versions, mask) == TRAINER_VERSION - 3
    assert lag(TRAINER_VERSION, GENERATED_VERSIONS) == TRAINER_VERSION - 3  # all loss tokens
    assert lag(TRAINER_VERSION, versions, [0] * len(versions)) == 0  # no loss tokens
    assert lag(2, [3]) == 0  # never below 0 (a newer version than the trainer's seen so far)


def test_the_batcher_the_progress_line_and_the_simulator_agree():
    n = len(PROMPT_VERSIONS) + len(GENERATED_VERSIONS)
    sample = SampleReady(
        sample_id="s-0",
        session_id="s",
        group_id="g",
        token_ids=list(range(n)),
        loss_mask=[0] * len(PROMPT_VERSIONS) + [1] * len(GENERATED_VERSIONS),
        logprobs=[0.0] * n,
        versions=PROMPT_VERSIONS + GENERATED_VERSIONS,
        reward=1.0,
        on_policy=False,
    )
    stats = RunStats(started_at=0.0)
    weights = WeightsPublished(
        version=TRAINER_VERSION, location="file:///w", sha256="0" * 64, size_bytes=1, published_at=1
    )
    stats.on_weights(weights, 1.0)
    stats.on_sample(sample, 2.0)
    group = _Group(0)
    # The simulator knows a sample's versions by its generations: one per engine placed on.
    group.samples.append(_Sample(group, lengths=[3], versions=GENERATED_VERSIONS))
    expected = TRAINER_VERSION - min(GENERATED_VERSIONS)
    assert batcher_lag(sample, TRAINER_VERSION) == expected
    assert stats.staleness() == expected
    assert group.samples[0].lag(TRAINER_VERSION) == expected
