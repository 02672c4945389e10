"""One training step on one rank, given the whole step's items (every rank gets the same list):
split into minibatches, take this rank's shard of each, pack it into rows, then one loss and one
``backend.apply`` per minibatch. No NATS here.

Proximal logprobs are those of the weights before the step's first update. With one minibatch
the training forward runs on exactly those weights, so its logprobs, detached, are the proximal
ones: one forward per step. With several, each later minibatch would see updated weights, so
every shard first gets a forward without gradients, before any update.

Loss normalisation uses each minibatch's loss tokens over ALL ranks, and the backend sums
gradients, so N ranks compute the same update as one rank on the whole batch.

``Accumulation`` is the same one-minibatch step computed in parts, groups at a time (the trainer's
``overlap``: while it would wait for a step's last groups): each part's loss is left un-normalised
(per-sample weights of ``1 / its loss tokens`` under sample aggregation) and backpropagated, its
gradients adding up; ``commit`` scales them by one over the step's loss tokens (or samples), all
ranks, then takes the optimizer step: the update ``train_step`` computes on the whole batch. The
weights do not move until the commit, so every part's forward gives the proximal logprobs.
"""

import time
from dataclasses import dataclass, field, replace

import torch

from trainer.backends.base import TrainerBackend
from trainer.batcher import BatchTensors, TrainItem, collate, split
from trainer.config import LossAggregation, TrainerConfig
from trainer.losses import LossTerms, Mismatch, mismatch, policy_loss


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
    seconds: dict[str, float]  # this rank's time by phase: PHASES


PHASES = ("proximal", "reference", "forward", "backward", "optimizer")
"""Where a step's time goes: the separate no-grad forwards (proximal: only with several
minibatches; reference: only with a KL term), the training forward with its loss, backward, and
the rest of the update (gradient reduction, clipping, optimizer)."""


def _loss_tokens(item: TrainItem) -> int:
    return sum(item.sample.loss_mask[1:])  # collate never trains on a sample's first token


def equal_sample_weights(items: list[TrainItem]) -> list[TrainItem]:
    """``items`` reweighted so that, in a loss summed over tokens and divided by the total, each
    sample weighs the same: its weight times the mean loss tokens per sample over its own."""
    mean = sum(_loss_tokens(i) for i in items) / max(len(items), 1)
    return [
        replace(i, weight=i.weight * mean / tokens) if (tokens := _loss_tokens(i)) else i
        for i in items
    ]


def train_step(
    backend: TrainerBackend, items: list[TrainItem], version: int, config: TrainerConfig
) -> StepStats:
    minibatches = split(items, config.minibatches)
    if config.loss_aggregation is LossAggregation.SAMPLE:
        minibatches = [equal_sample_weights(mb) for mb in minibatches]
    totals = [sum(_loss_tokens(i) for i in mb) for mb in minibatches]
    shards = [mb[backend.dp_rank :: backend.dp_size] for mb in minibatches]
    batches = [
        collate(shard, backend.row_tokens, backend.shares_prefixes) if shard else None
        for shard in shards
    ]
    seconds = dict.fromkeys(PHASES, 0.0)
    proximals, references = _before_updates(backend, batches, config, seconds)
    # 2. One optimizer step per minibatch; a rank without samples still joins the reduction.
    loss_sum = kl_sum = 0.0
    rank_tokens = clipped = capped = 0
    grad_norm = 0.0
    scored: list[tuple[BatchTensors, torch.Tensor]] = []
    for total, batch, proximal, reference in zip(
        totals, batches, proximals, references, strict=True
    ):
        if total == 0:  # no loss token on any rank: no optimizer step (AdamW would still move)
            continue
        clock = time.perf_counter()
        terms = None
        if batch is not None:
            terms, proximal = minibatch_loss(backend, batch, total, config, proximal, reference)
        applied_at = time.perf_counter()
        applied = backend.apply(None if terms is None else terms.loss)
        grad_norm = applied.grad_norm
        seconds["forward"] += applied_at - clock
        seconds["backward"] += applied.backward_s
        seconds["optimizer"] += time.perf_counter() - applied_at - applied.backward_s
        if terms is None:  # a rank without samples joined the reduction
            continue
        scored.append((batch, proximal))
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
        mismatch=_mismatch(scored, version),
        grad_norm=grad_norm,
        clipped_tokens=clipped,
        capped_tokens=capped,
        seconds=seconds,
    )


def _before_updates(
    backend: TrainerBackend,
    batches: list[BatchTensors | None],
    config: TrainerConfig,
    seconds: dict[str, float],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Before any update: proximal logprobs when there are several updates, and reference
    logprobs with a KL term; their time goes to ``seconds``."""
    separate = len(batches) > 1
    clock = time.perf_counter()
    proximals = [proximal_logprobs(backend, b) if b and separate else None for b in batches]
    if separate:
        seconds["proximal"] = time.perf_counter() - clock
    clock = time.perf_counter()
    references = [
        backend.reference_logprobs(b.tokens).float() if b and config.kl_coef > 0 else None
        for b in batches
    ]
    if config.kl_coef > 0:
        seconds["reference"] = time.perf_counter() - clock
    return proximals, references


def proximal_logprobs(backend: TrainerBackend, batch: BatchTensors) -> torch.Tensor:
    """The current weights' logprobs of ``batch``, without gradients."""
    return backend.token_logprobs(batch.tokens, grad=False).float()


def minibatch_loss(
    backend: TrainerBackend,
    batch: BatchTensors,
    total_tokens: int,
    config: TrainerConfig,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[LossTerms, torch.Tensor]:
    """The training forward of ``batch`` (this rank's shard of a minibatch with ``total_tokens``
    loss tokens over all ranks) and its loss, with the proximal logprobs it used: ``proximal``
    when given, else this forward's own, detached (right while the weights have not moved)."""
    logp = backend.token_logprobs(batch.tokens, grad=True).float()
    device = logp.device
    proximal = logp.detach() if proximal is None else proximal.to(device)
    terms = policy_loss(
        logp,
        proximal,
        batch.behaviour.to(device),
        batch.advantages.to(device),
        batch.mask.to(device),
        batch.weights.to(device),
        clip_low=config.clip_eps_low,
        clip_high=config.clip_eps_high,
        importance_cap=config.importance_cap,
        total_tokens=total_tokens,
        reference=None if reference is None else reference.to(device),
        kl_coef=config.kl_coef,
    )
    return terms, proximal


def _mismatch(scored: list[tuple[BatchTensors, torch.Tensor]], version: int) -> Mismatch:
    """Behaviour vs proximal logprobs over the loss tokens ``version`` generated."""
    if not scored:
        return Mismatch(0, 0.0, 0.0, 0.0)
    behaviour = torch.cat([b.behaviour.flatten() for b, _ in scored])
    proximal = torch.cat([p.cpu().flatten() for _, p in scored])
    same = torch.cat([((b.mask > 0) & (b.versions == version)).flatten() for b, _ in scored])
    return mismatch(behaviour, proximal, same)


@dataclass
class Accumulation:
    """A step being computed part by part, on one rank (see the module docstring)."""

    items: list[TrainItem] = field(default_factory=list)  # every part's, all ranks
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    _scored: list[tuple[BatchTensors, torch.Tensor]] = field(default_factory=list)
    _policy: float = 0.0  # un-normalised sums over this rank's loss tokens
    _kl: float = 0.0
    _tokens: int = 0
    _clipped: int = 0
    _capped: int = 0

    def add(self, backend: TrainerBackend, items: list[TrainItem], config: TrainerConfig) -> None:
        """Forward and backward this rank's shard of ``items``; gradients are kept, not applied."""
        self.items += items
        shard = items[backend.dp_rank :: backend.dp_size]
        if config.loss_aggregation is LossAggregation.SAMPLE:
            shard = [replace(i, weight=i.weight / max(_loss_tokens(i), 1)) for i in shard]
        if not shard or not sum(map(_loss_tokens, shard)):
            return
        batch = collate(shard, backend.row_tokens, backend.shares_prefixes)
        clock = time.perf_counter()
        reference = None
        if config.kl_coef > 0:
            reference = backend.reference_logprobs(batch.tokens).float()
            self.seconds["reference"] += time.perf_counter() - clock
            clock = time.perf_counter()
        terms, proximal = minibatch_loss(backend, batch, 1, config, None, reference)
        backward_at = time.perf_counter()
        terms.loss.backward()
        self.seconds["forward"] += backward_at - clock
        self.seconds["backward"] += time.perf_counter() - backward_at
        self._scored.append((batch, proximal))
        self._tokens += batch.loss_tokens
        self._policy += terms.policy_loss
        self._kl += terms.kl * batch.loss_tokens
        self._clipped += terms.clipped_tokens
        self._capped += terms.capped_tokens

    def commit(self, backend: TrainerBackend, version: int, config: TrainerConfig) -> StepStats:
        """Scale the gradients (every rank), take the optimizer step; what the step did."""
        tokens = sum(map(_loss_tokens, self.items))
        per_sample = config.loss_aggregation is LossAggregation.SAMPLE
        norm = len(self.items) if per_sample else tokens
        grad_norm = 0.0
        if tokens:  # else no loss token on any rank: no optimizer step (AdamW would still move)
            clock = time.perf_counter()
            applied = backend.apply(None, scale=1.0 / norm)
            grad_norm = applied.grad_norm
            self.seconds["optimizer"] += time.perf_counter() - clock
        policy = self._policy * (tokens / norm if per_sample else 1.0)  # train_step's units
        return StepStats(
            samples=len(self.items),
            loss_tokens=tokens,
            loss=policy / max(self._tokens, 1),
            kl=self._kl / max(self._tokens, 1),
            mismatch=_mismatch(self._scored, version),
            grad_norm=grad_norm,
            clipped_tokens=self._clipped,
            capped_tokens=self._capped,
            seconds=self.seconds,
        )
