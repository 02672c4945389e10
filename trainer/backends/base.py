"""The interface every trainer backend implements (``torch`` here, ``megatron`` elsewhere).

A backend owns the model, the optimizer and the data-parallel gradient reduction; the trainer
owns everything else (batching, advantages, losses, checkpoints, NATS). Layout conventions:

- A ``TokenBatch`` holds whole samples packed into rows (``(R, T)`` tensors): a row is one or
  more samples back to back, then padding. ``position_ids`` count from 0 at each sample's first
  token, and a token attends only to the earlier tokens of its own sample. A backend that cannot
  isolate samples sharing a row reports ``row_tokens == 1`` and gets one sample per row.
- Samples that begin alike (a GRPO group's prompt, a conversation tree's trunk) may instead be
  laid out one per row with ``TokenBatch.prefixes`` naming the rows that share their first
  tokens, none of them read. A backend with ``shares_prefixes`` runs each prefix once and the
  rest of its rows on top of it (its keys and values); the rows are whole, so any backend may
  also compute them as they are.
- ``token_logprobs`` returns ``(R, T)`` float32 where ``[r, t]`` is the log-probability of
  ``input_ids[r, t]`` given the earlier tokens of its sample; a sample's first token (no context)
  and padding are 0. Within a sample this is the position convention of ``SampleReady.logprobs``,
  so the two line up index by index.
- The trainer builds each rank's loss already divided by the GLOBAL number of loss tokens (all
  ranks), so ``apply`` must SUM gradients over the data-parallel group (not average them): then
  N ranks on N shards give the same update as one rank on the whole batch.
- ``hf_state_dict`` uses Hugging Face parameter names and float tensors on CPU, full (not
  sharded) on every rank that calls it; tied embeddings appear once (``lm_head.weight`` may be
  omitted when tied).

Construction: each backend module exposes ``build(model: Path, config: TrainerConfig) ->
TrainerBackend`` (see ``trainer.backends.build_backend``); ``torch.distributed`` is already
initialised when ``build`` is called with ``world_size > 1``. Backend methods are blocking: the
trainer calls them off the event loop.
"""

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SharedPrefix:
    """Rows whose samples begin with the same ``length`` tokens, of which none is read (so only
    the last prefix position's logits matter): ``groups`` holds the row indices of each distinct
    prefix. All prefixes of one ``SharedPrefix`` have the same length, so they run as one batch.
    """

    length: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def rows(self) -> list[int]:
        return [r for group in self.groups for r in group]


@dataclass(frozen=True)
class TokenBatch:
    """Token ids of some samples packed into rows, on CPU; the backend moves them to its device.
    Padding only ever follows a row's last sample, so causal attention keeps samples from it."""

    input_ids: torch.Tensor  # (R, T) int64
    position_ids: torch.Tensor  # (R, T) int64, 0 at each sample's first token
    attention_mask: torch.Tensor  # (R, T) int64, 1 on sample tokens, 0 on padding
    read: torch.Tensor | None = None
    """(R, T) bool: the tokens whose logprob is read (the loss tokens); a backend may leave the
    others 0 and skip their logits. None: every token."""
    prefixes: tuple[SharedPrefix, ...] = ()
    """Only in a batch with one sample per row; a row is in at most one of them."""

    def select(self, rows: list[int], length: int) -> "TokenBatch":
        """These ``rows``, cut to their first ``length`` columns, without ``prefixes``."""
        index = torch.tensor(rows)

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[index, :length]

        read = None if self.read is None else cut(self.read)
        return TokenBatch(
            cut(self.input_ids), cut(self.position_ids), cut(self.attention_mask), read
        )

    @property
    def packed(self) -> bool:
        """Whether some row holds more than one sample."""
        return bool((self.position_ids[:, 1:] == 0).any())


@dataclass(frozen=True)
class ApplyStats:
    """What one optimizer step reports."""

    grad_norm: float  # total gradient norm before clipping (after the data-parallel reduction)
    lr: float
    backward_s: float  # of the step's time, in ``loss.backward()``; the rest: reduce, clip, update


@runtime_checkable
class TrainerBackend(Protocol):
    """A policy model with its optimizer, one per trainer rank."""

    @property
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel group (0 when alone)."""
        ...

    @property
    def dp_size(self) -> int:
        """Ranks in the data-parallel group; the trainer gives each its own shard of a batch."""
        ...

    @property
    def row_tokens(self) -> int:
        """Tokens a row of a ``TokenBatch`` may hold (a longer sample gets a row of its own);
        1 when the backend takes one sample per row."""
        ...

    @property
    def shares_prefixes(self) -> bool:
        """Whether ``token_logprobs`` runs each of a batch's ``prefixes`` once (else a batch is
        better packed than laid out for them)."""
        ...

    def token_logprobs(self, batch: TokenBatch, grad: bool) -> torch.Tensor:
        """Per-token log-probabilities ``(B, T)`` (see the module docstring); with ``grad`` the
        result is attached to the graph for ``apply``, without it it is computed under no_grad.
        The result may live on the backend's device."""
        ...

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Like ``token_logprobs(batch, grad=False)`` but from the frozen reference model, which
        exists only when ``config.kl_coef > 0``; raises ``BackendError`` otherwise."""
        ...

    def apply(self, loss: torch.Tensor | None, scale: float = 1.0) -> ApplyStats:
        """Backward ``loss``, multiply the gradients (with those of any ``backward`` since the
        last ``apply``) by ``scale``, sum them over the data-parallel group, clip to
        ``config.max_grad_norm``, take one optimizer step and zero the gradients. ``None``: no
        new loss on this rank (no samples in this minibatch); it still joins the reduction and
        the step (every rank calls ``apply`` the same number of times)."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last ``apply`` (a step abandoned)."""
        ...

    def offload(self) -> None:
        """Hand the device's memory over (a colocated worker lent to rollout): model, gradients
        and optimizer state move to host memory until ``onload``; whatever reads or loads the
        state meanwhile works on them there. On a CPU there is nothing to hand over."""
        ...

    def onload(self) -> None:
        """Bring back what ``offload`` moved, before the next step."""
        ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights under Hugging Face names, as CPU tensors, for publication. They
        may be the model's own (a model on CPU is not copied): read them before the next
        ``apply`` changes them, or copy them."""
        ...

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint needs to resume this rank exactly (model + optimizer),
        as a ``torch.save``-able object."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what ``state`` returned."""
        ...


def logprobs_from_logits(
    logits: torch.Tensor,
    batch: TokenBatch,
    temperature: float = 1.0,
    at: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[r, t]`` = log p(ids[r, t] | the earlier tokens of its sample) from ``[r, k, vocab]``
    logits at the sampling ``temperature`` (the distribution rollout sampled from, as its
    behaviour logprobs are); a sample's first token, padding and tokens without logits are 0.
    ``at``: the k positions the logits were computed at (``logit_positions``), None for all.
    The one reading of logits for every backend."""
    ids = batch.input_ids.to(logits.device)
    if at is None:  # logits at every position; the last one predicts nothing
        at = torch.arange(ids.shape[1] - 1, device=logits.device)
        logits = logits[:, :-1]
    targets = at.to(logits.device) + 1
    scored = (batch.attention_mask[:, targets] > 0) & (batch.position_ids[:, targets] > 0)
    shifted = logits.float() / temperature
    picked = shifted.gather(-1, ids[:, targets, None]).squeeze(-1)
    logp = picked - torch.logsumexp(shifted, dim=-1)
    out = torch.zeros(ids.shape, dtype=logp.dtype, device=logits.device)
    out[:, targets] = torch.where(scored.to(logits.device), logp, 0.0)
    return out


def logit_positions(batch: TokenBatch) -> torch.Tensor | None:
    """The positions whose logits predict a token that is read (``batch.read`` shifted by one,
    over all rows), or None for all of them."""
    if batch.read is None:
        return None
    return torch.nonzero(batch.read[:, 1:].any(dim=0)).squeeze(1)
