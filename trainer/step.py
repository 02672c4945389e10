"""One training step on one rank, given the whole step's items (every rank gets the same list):
split into minibatches, take this rank's shard of each, recompute proximal logprobs before any
update, then one loss and one ``backend.apply`` per minibatch. No NATS here.

Loss normalisation uses each minibatch's loss tokens over ALL ranks, and the backend sums
gradients, so N ranks compute the same update as one rank on the whole batch.
"""

from dataclasses import dataclass

import torch

from trainer.backends.base import TrainerBackend
from trainer.batcher import BatchTensors, TrainItem, collate, split
from trainer.config import TrainerConfig
from trainer.losses import Mismatch, mismatch, policy_loss


@dataclass(frozen=True)
class StepStats:
    """What one step did, seen from this rank (its shards)."""

    samples: int  # trained, all ranks
    loss_tokens: int  # all ranks
    loss: float  # mean policy loss per loss token of this rank's shards
    kl: float
    mismatch: Mismatch
    grad_norm: float
    clipped_tokens: int
    capped_tokens: int


def _loss_tokens(item: TrainItem) -> int:
    return sum(item.sample.loss_mask[1:])  # collate never trains on position 0


def train_step(
    backend: TrainerBackend, items: list[TrainItem], version: int, config: TrainerConfig
) -> StepStats:
    minibatches = split(items, config.minibatches)
    totals = [sum(_loss_tokens(i) for i in mb) for mb in minibatches]
    shards = [mb[backend.dp_rank :: backend.dp_size] for mb in minibatches]
    # 1. Proximal (and reference) logprobs with the weights before the update.
    prepared: list[tuple[BatchTensors, torch.Tensor, torch.Tensor | None] | None] = []
    for shard in shards:
        if not shard:
            prepared.append(None)
            continue
        batch = collate(shard)
        proximal = backend.token_logprobs(batch.tokens, grad=False).float().cpu()
        reference = None
        if config.kl_coef > 0:
            reference = backend.reference_logprobs(batch.tokens).float().cpu()
        prepared.append((batch, proximal, reference))
    seen = _mismatch([p for p in prepared if p is not None], version)
    # 2. One optimizer step per minibatch; a rank without samples still joins the reduction.
    loss_sum = kl_sum = 0.0
    rank_tokens = clipped = capped = 0
    grad_norm = 0.0
    for total, entry in zip(totals, prepared, strict=True):
        if total == 0:  # no loss token on any rank: no optimizer step (AdamW would still move)
            continue
        if entry is None:
            grad_norm = backend.apply(None).grad_norm
            continue
        batch, proximal, reference = entry
        logp = backend.token_logprobs(batch.tokens, grad=True)
        device = logp.device
        terms = policy_loss(
            logp.float(),
            proximal.to(device),
            batch.behaviour.to(device),
            batch.advantages.to(device),
            batch.mask.to(device),
            batch.weights.to(device),
            clip_low=config.clip_eps_low,
            clip_high=config.clip_eps_high,
            importance_cap=config.importance_cap,
            total_tokens=total,
            reference=None if reference is None else reference.to(device),
            kl_coef=config.kl_coef,
        )
        grad_norm = backend.apply(terms.loss).grad_norm
        tokens = batch.loss_tokens
        rank_tokens += tokens
        loss_sum += terms.policy_loss * total
        kl_sum += terms.kl * tokens
        clipped += terms.clipped_tokens
        capped += terms.capped_tokens
    return StepStats(
        samples=len(items),
        loss_tokens=sum(totals),
        loss=loss_sum / max(rank_tokens, 1),
        kl=kl_sum / max(rank_tokens, 1),
        mismatch=seen,
        grad_norm=grad_norm,
        clipped_tokens=clipped,
        capped_tokens=capped,
    )


def _mismatch(prepared: list[tuple[BatchTensors, torch.Tensor, torch.Tensor | None]], version: int):
    if not prepared:
        return Mismatch(0, 0.0, 0.0, 0.0)
    behaviour = torch.cat([b.behaviour.flatten() for b, _, _ in prepared])
    proximal = torch.cat([p.flatten() for _, p, _ in prepared])
    same = torch.cat([((b.mask > 0) & (b.versions == version)).flatten() for b, _, _ in prepared])
    return mismatch(behaviour, proximal, same)
