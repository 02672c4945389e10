"""The trainer's metrics (steps, samples, losses, weight publication), in one registry, and
what a trained step reports."""

import logging
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker.messages import SampleReady
from common.log import kv
from trainer.batcher import DROPPED, DropReason, Outcome, TrainItem, lag, oldest_version
from trainer.config import TrainerConfig
from trainer.step import PHASES, StepStats

log = logging.getLogger(__name__)

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

STEPS = Counter("sf_trainer_steps", "Training steps committed", registry=REGISTRY)
VERSION = Gauge("sf_trainer_version", "Weight version the trainer holds", registry=REGISTRY)
SAMPLES = Counter(
    "sf_trainer_samples", "Samples consumed, by outcome", ["outcome"], registry=REGISTRY
)
for _outcome in Outcome:  # every outcome exported from the start, at 0
    SAMPLES.labels(_outcome.value)
DROPPED_SAMPLES = Counter(
    "sf_trainer_samples_dropped",
    "Samples consumed but not trained, by reason (each group's drop is also a WARNING line "
    "and the step's line in steps.jsonl names them)",
    ["reason"],
    registry=REGISTRY,
)
for _reason in DropReason:
    DROPPED_SAMPLES.labels(_reason.value)
INVALID = Counter(
    "sf_trainer_invalid_samples",
    "Samples refused because they contradict their group",
    registry=REGISTRY,
)
HELD = Gauge(
    "sf_trainer_samples_held", "Samples held un-acked until their step commits", registry=REGISTRY
)
LOSS = Gauge(
    "sf_trainer_loss",
    "Policy loss per loss token of the last step (rank 0's shard)",
    registry=REGISTRY,
)
REWARD = Gauge(
    "sf_trainer_reward_mean", "Mean reward of the last step's samples", registry=REGISTRY
)
ADV_STD = Gauge("sf_trainer_advantage_std", "Std of the last step's advantages", registry=REGISTRY)
KL = Gauge("sf_trainer_kl", "Mean k3 KL to the reference model in the last step", registry=REGISTRY)
GRAD_NORM = Gauge(
    "sf_trainer_grad_norm", "Gradient norm before clipping, last optimizer step", registry=REGISTRY
)
MISMATCH = Gauge(
    "sf_trainer_mismatch",
    "Behaviour vs proximal logprobs on same-version tokens, last step",
    ["stat"],  # mean_abs, max_abs, kl
    registry=REGISTRY,
)
MISMATCH_HIST = Histogram(
    "sf_trainer_mismatch_mean_abs",
    "Per step: mean |behaviour - proximal| logprob on same-version tokens",
    # fp32 on one device agrees to ~1e-7 (observed ~5e-7): the buckets reach well below that
    buckets=(1e-9, 1e-8, 1e-7, 3e-7, 1e-6, 3e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.5, 1, 5),
    registry=REGISTRY,
)
STALENESS = Histogram(
    "sf_trainer_sample_staleness",
    "Versions a sample's oldest loss token lags the trainer",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
    registry=REGISTRY,
)
STAMP_GAP = Histogram(
    "sf_trainer_admission_stamp_gap",
    "Versions a group's oldest loss token is newer than its admission stamp (trainer.order: the "
    "stamp is a lower bound; the gap is how early the trainer may wait)",
    buckets=(0, 1, 2, 3, 4, 8),
    registry=REGISTRY,
)
STEP_SECONDS = Histogram(
    "sf_trainer_step_seconds", "Training (all ranks) per step", buckets=_SECONDS, registry=REGISTRY
)
CHECKPOINT_SECONDS = Histogram(
    "sf_trainer_checkpoint_seconds",
    "Writing one checkpoint (in the background, off the training path)",
    buckets=_SECONDS,
    registry=REGISTRY,
)
CHECKPOINT_STALL_SECONDS = Histogram(
    "sf_trainer_checkpoint_stall_seconds",
    "What one checkpoint took from the training path: waiting for the previous one's write, "
    "if still going, and copying model and optimizer state into memory",
    buckets=_SECONDS,
    registry=REGISTRY,
)
PUBLISH_SECONDS = Histogram(
    "sf_trainer_weight_publish_seconds",
    "From a version's optimizer step to its announcement, by path: local (in the step: the "
    "handover to a colocated engine, then the host-local copy or the held announcement) or "
    "store (the object store or weights_dir, in the background)",
    ["path"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
WEIGHTS_HELD = Counter(
    "sf_trainer_weight_versions_held_total",
    "Versions announced as held by the engine in the trainer's own process, no file written "
    "in the step (a lone colocated worker: trainer.publisher)",
    registry=REGISTRY,
)
SERVING_SECONDS = Histogram(
    "sf_trainer_weights_serving_seconds",
    "From an optimizer step to every rollout worker serving its version",
    buckets=_SECONDS,
    registry=REGISTRY,
)
TOKENS = Counter("sf_trainer_tokens", "Loss tokens trained", registry=REGISTRY)
DROPPED_TOKENS = Counter(
    "sf_trainer_tokens_dropped",
    "Loss tokens of the samples consumed but not trained (generated, then thrown away)",
    registry=REGISTRY,
)
PHASE_SECONDS = Counter(
    "sf_trainer_phase_seconds",
    "Rank 0's training time by phase (trainer.step.PHASES): proximal, reference, forward, "
    "backward, optimizer",
    ["phase"],
    registry=REGISTRY,
)
for _phase in PHASES:  # exported from the start, at 0
    PHASE_SECONDS.labels(_phase)
GROUPS_EXPIRED = Counter(
    "sf_trainer_groups_expired",
    "Groups trained incomplete after group_timeout_s",
    registry=REGISTRY,
)
AHEAD = Gauge(
    "sf_trainer_groups_ahead",
    "Groups of the next step computed ahead, waiting for the rest (trainer.overlap)",
    registry=REGISTRY,
)
AHEAD_PASSES = Histogram(
    "sf_trainer_ahead_pass_groups",
    "Groups computed in one forward and backward pass of a step computed ahead (trainer.overlap: "
    "every complete group waiting; one each while the trainer keeps up with the rollout)",
    buckets=(1, 2, 4, 8, 16, 32, 64),
    registry=REGISTRY,
)
ORDER_WAIT = Counter(
    "sf_trainer_order_wait_seconds",
    "Seconds steps waited for an earlier admitted task's group (trainer.order)",
    registry=REGISTRY,
)
ORDER_GIVEN_UP = Counter(
    "sf_trainer_order_given_up",
    "Admitted tasks a step stopped waiting for after order_wait_s (no group in time)",
    registry=REGISTRY,
)


def report_plan(
    groups: list[list[SampleReady]],
    outcomes: dict[str, Outcome],
    lags: list[int],
    version: int,
    config: TrainerConfig,
) -> tuple[tuple[str, str], ...]:
    """What ``plan_step`` made of ``groups`` at ``version``: staleness, stamp gaps and outcomes
    counted, each group's dropped samples counted and logged (WARNING, a line per group and
    reason); returns the dropped ones as ``(sample_id, reason)`` for the steps log."""
    for behind in lags:
        STALENESS.observe(behind)
    for outcome in outcomes.values():
        SAMPLES.labels(outcome.value).inc()
    dropped: list[tuple[str, str]] = []
    for group in groups:
        if (stamp := group[0].admitted) is not None:
            STAMP_GAP.observe(min(map(oldest_version, group)) - stamp.version)
        gone = [s for s in group if outcomes[s.sample_id] in DROPPED]
        for reason in {DROPPED[outcomes[s.sample_id]] for s in gone}:
            these = [s for s in gone if DROPPED[outcomes[s.sample_id]] is reason]
            DROPPED_SAMPLES.labels(reason.value).inc(len(these))
            DROPPED_TOKENS.inc(sum(sum(s.loss_mask[1:]) for s in these))
            dropped += [(s.sample_id, reason.value) for s in these]
            log.warning(
                kv(
                    "samples_dropped",
                    group=group[0].group_id,
                    reason=reason.value,
                    samples=len(these),
                    of=len(group),
                    max_lag=max(lag(s, version) for s in these),
                    version=version,
                    max_staleness=config.max_staleness,
                )
            )
    return tuple(dropped)


def report_step(version: int, items: list[TrainItem], stats: StepStats, seconds: float) -> None:
    """A trained step's metrics and its ``train_step`` line."""
    rewards = [i.sample.reward for i in items]
    advantages = [i.advantage for i in items]
    mean_adv = sum(advantages) / len(advantages)
    adv_std = math.sqrt(sum((a - mean_adv) ** 2 for a in advantages) / len(advantages))
    reward_mean = sum(rewards) / len(rewards)
    STEPS.inc()
    TOKENS.inc(stats.loss_tokens)
    for phase, spent in stats.seconds.items():
        PHASE_SECONDS.labels(phase).inc(spent)
    LOSS.set(stats.loss)
    REWARD.set(reward_mean)
    ADV_STD.set(adv_std)
    KL.set(stats.kl)
    GRAD_NORM.set(stats.grad_norm)
    m = stats.mismatch
    if m.tokens:
        MISMATCH.labels("mean_abs").set(m.mean_abs)
        MISMATCH.labels("max_abs").set(m.max_abs)
        MISMATCH.labels("kl").set(m.kl)
        MISMATCH_HIST.observe(m.mean_abs)
    log.info(
        kv(
            "train_step",
            version=version,
            samples=stats.samples,
            tokens=stats.loss_tokens,
            reward_mean=round(reward_mean, 4),
            loss=round(stats.loss, 6),
            kl=round(stats.kl, 6),
            grad_norm=round(stats.grad_norm, 4),
            mismatch_tokens=m.tokens,
            mismatch_mean_abs=round(m.mean_abs, 6),
            mismatch_max_abs=round(m.max_abs, 6),
            mismatch_kl=round(m.kl, 8),
            seconds=round(seconds, 3),
        )
    )


GROUP_SIZE = Gauge(
    "sf_trainer_group_size",
    "Workers in the trainer group this worker follows (trainer.group)",
    registry=REGISTRY,
)
GROUP_GENERATION = Gauge(
    "sf_trainer_group_generation", "Generation of the trainer group followed", registry=REGISTRY
)
GROUP_RANK = Gauge(
    "sf_trainer_group_rank",
    "This worker's rank in the trainer group; -1 outside it (it takes no samples)",
    registry=REGISTRY,
)
GROUP_REFORMS = Counter(
    "sf_trainer_group_reforms",
    "Trainer group formations by its rank 0, by cause: a new generation (membership), a failed "
    "collective (failure: a member died or timed out), an earlier rendezvous that timed out",
    ["cause"],
    registry=REGISTRY,
)
for _cause in ("membership", "failure", "rendezvous"):
    GROUP_REFORMS.labels(_cause)
GROUP_REFUSED = Counter(
    "sf_trainer_group_refused",
    "Trainer group records this worker could not join (trainer.world_size > 1 local ranks)",
    registry=REGISTRY,
)
GROUP_INVALID = Counter(
    "sf_trainer_group_entries_invalid",
    "trainer-group / trainer-rendezvous entries of the state bucket that did not decode (skipped)",
    registry=REGISTRY,
)
RENDEZVOUS_SECONDS = Histogram(
    "sf_trainer_group_rendezvous_seconds",
    "From the rendezvous opened (rank 0) or read (others) to the group formed, state sent",
    buckets=_SECONDS,
    registry=REGISTRY,
)
RANK_STEP_SECONDS = Histogram(
    "sf_trainer_rank_step_seconds",
    "One training command on this rank (its shard of a step, or of a part computed ahead), in a "
    "trainer group of workers",
    buckets=_SECONDS,
    registry=REGISTRY,
)
