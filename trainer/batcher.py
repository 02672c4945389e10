"""Complete groups into training batches, pure Python (no NATS): which samples a step takes, with
which advantage and weight.

A group is complete when it holds samples from ``group_size`` distinct sessions, each with all of
its ``session_samples``, or when it has waited ``group_timeout_s`` (some session ended without
samples). Groups leave in the order they completed. Advantages are computed over the group's
sessions (one reward each), not its samples. At step time every sample is
checked against the staleness bound: its lag is the trainer's version minus the oldest version of
its loss tokens (``common.staleness``).
"""

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from broker.messages import MAX_SAFE_INT, SampleReady
from common import staleness
from common.staleness import StalenessMode
from trainer.backends.base import SharedPrefix, TokenBatch
from trainer.config import TrainerConfig
from trainer.exceptions import BatchError
from trainer.losses import group_advantages
from trainer.order import AdmissionOrder


class Outcome(StrEnum):
    """What became of a sample (the label of ``sf_trainer_samples``)."""

    TRAINED = "trained"
    DOWNWEIGHTED = "downweighted"
    STALE_DROPPED = "stale_dropped"
    DUPLICATE = "duplicate"


class DropReason(StrEnum):
    """Why a consumed sample was not trained (the label of ``sf_trainer_samples_dropped``)."""

    STALE = "stale"  # its oldest loss token lags the trainer past max_staleness (mode drop)


DROPPED = {Outcome.STALE_DROPPED: DropReason.STALE}
"""The outcomes that drop a sample, and the reason each gives."""


@dataclass
class _Group:
    size: int
    opened_at: float
    sessions: dict[str, dict[str, SampleReady]] = field(default_factory=dict)
    session_samples: dict[str, int] = field(default_factory=dict)

    def complete(self) -> bool:
        return len(self.sessions) == self.size and all(
            len(samples) == self.session_samples[s] for s, samples in self.sessions.items()
        )

    def samples(self) -> list[SampleReady]:
        return [s for samples in self.sessions.values() for s in samples.values()]


class Batcher:
    """Samples in, complete groups out. ``add`` refuses a sample that contradicts its group.
    ``order`` learns which admitted tasks' groups have arrived (``trainer.order``)."""

    def __init__(self, order: AdmissionOrder) -> None:
        self.order = order
        self._open: dict[str, _Group] = {}
        self._complete: OrderedDict[str, list[SampleReady]] = OrderedDict()
        self._held: set[str] = set()

    @property
    def complete_groups(self) -> int:
        return len(self._complete)

    def holds(self, sample_id: str) -> bool:
        return sample_id in self._held

    def add(self, sample: SampleReady) -> None:
        """Hold ``sample`` until its group completes. Raises ``BatchError`` if it is held already
        or disagrees with its group (size, session sample count, one session too many)."""
        if sample.sample_id in self._held:
            raise BatchError(f"sample {sample.sample_id} is already held")
        if sample.group_id in self._complete:
            raise BatchError(f"sample {sample.sample_id}: group {sample.group_id} is complete")
        group = self._open.get(sample.group_id)
        if group is None:
            group = self._open[sample.group_id] = _Group(sample.group_size, time.monotonic())
        where = f"sample {sample.sample_id} of group {sample.group_id}"
        if sample.group_size != group.size:
            raise BatchError(f"{where}: group_size {sample.group_size}, the group has {group.size}")
        known = group.session_samples.setdefault(sample.session_id, sample.session_samples)
        if known != sample.session_samples:
            raise BatchError(
                f"{where}: session_samples {sample.session_samples}, session "
                f"{sample.session_id} said {known}"
            )
        session = group.sessions.get(sample.session_id)
        if session is None:
            if len(group.sessions) == group.size:
                del group.session_samples[sample.session_id]
                raise BatchError(f"{where}: more than group_size={group.size} sessions")
            session = group.sessions[sample.session_id] = {}
        if len(session) == sample.session_samples:
            raise BatchError(
                f"{where}: session {sample.session_id} already has its "
                f"{sample.session_samples} samples"
            )
        session[sample.sample_id] = sample
        self._held.add(sample.sample_id)
        if sample.admitted is not None:
            self.order.seen(sample.admitted)
        if group.complete():
            del self._open[sample.group_id]
            self._completed(sample.group_id, group.samples())

    def expire(self, timeout_s: float) -> int:
        """Close the groups opened more than ``timeout_s`` ago with the sessions they have (a
        session can end without samples: its agent failed before its first call). Returns how
        many were closed."""
        now = time.monotonic()
        expired = [g for g, group in self._open.items() if now - group.opened_at > timeout_s]
        for group_id in expired:
            self._completed(group_id, self._open.pop(group_id).samples())
        return len(expired)

    def _completed(self, group_id: str, samples: list[SampleReady]) -> None:
        self._complete[group_id] = samples
        if (admitted := samples[0].admitted) is not None:
            self.order.completed(admitted)

    def restore(self, groups: list[list[SampleReady]]) -> None:
        """Put back groups ``take`` gave out (their step was abandoned), first in line."""
        for group in reversed(groups):
            self._complete[group[0].group_id] = group
            self._complete.move_to_end(group[0].group_id, last=False)
            self._held.update(s.sample_id for s in group)

    def take(self, groups: int) -> list[list[SampleReady]] | None:
        """The ``groups`` complete groups with the oldest loss tokens (nearest the staleness
        bound; of equals, the first admitted, then the first complete), or None while fewer
        are complete."""
        if len(self._complete) < groups:
            return None
        oldest = sorted(self._complete, key=lambda g: _age(self._complete[g]))
        taken = [self._complete.pop(g) for g in oldest[:groups]]
        for group in taken:
            self._held.difference_update(s.sample_id for s in group)
        return taken


def _age(group: list[SampleReady]) -> tuple[int, int]:
    """Which group ``Batcher.take`` takes first: its oldest loss token, then its ticket."""
    admitted = group[0].admitted
    return min(map(oldest_version, group)), MAX_SAFE_INT if admitted is None else admitted.ticket


@dataclass(frozen=True)
class TrainItem:
    """A sample as a step trains it."""

    sample: SampleReady
    advantage: float
    weight: float  # 1.0, or stale_weight past the staleness bound


@dataclass
class StepAhead:
    """A step computed ahead as its groups complete (``trainer.overlap``), in one formation of
    the trainer group: its groups so far, what they train and what they drop."""

    formation: int
    groups: list[list[SampleReady]] = field(default_factory=list)
    items: list[TrainItem] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    trained: int = 0  # groups with something to train (a group dropped whole counts none)
    seconds: float = 0.0  # computing them

    def add(self, groups: list[list[SampleReady]], items: list[TrainItem], dropped: tuple) -> None:
        """``groups``, computed in one pass: ``items`` trained of them, ``dropped`` samples."""
        trains = {i.sample.sample_id for i in items}
        self.groups += groups
        self.items += items
        self.dropped += dropped
        self.trained += sum(any(s.sample_id in trains for s in g) for g in groups)

    @property
    def consumed(self) -> list[str]:
        return [s.sample_id for g in self.groups for s in g]


def oldest_version(sample: SampleReady) -> int:
    """The version of the sample's oldest loss token (without any: above every version)."""
    first = staleness.oldest(sample.versions, sample.loss_mask)
    return MAX_SAFE_INT if first is None else first


def lag(sample: SampleReady, version: int) -> int:
    """Versions the sample's oldest loss token lags ``version`` (``common.staleness.lag``)."""
    return staleness.lag(version, sample.versions, sample.loss_mask)


def plan_step(
    groups: list[list[SampleReady]], version: int, config: TrainerConfig
) -> tuple[list[TrainItem], dict[str, Outcome], list[int]]:
    """Advantages over each whole group, then the staleness bound per sample. Returns the items
    to train, every sample's outcome, and every sample's lag."""
    items: list[TrainItem] = []
    outcomes: dict[str, Outcome] = {}
    lags: list[int] = []
    for group in groups:
        # One reward per session (a session with several leaves is still one attempt).
        rewards = {s.session_id: s.reward for s in group}
        by_session = dict(
            zip(
                rewards,
                group_advantages(list(rewards.values()), config.advantage, config.std_eps),
                strict=True,
            )
        )
        for sample in group:
            advantage = by_session[sample.session_id]
            behind = lag(sample, version)
            lags.append(behind)
            if behind <= config.max_staleness:
                outcomes[sample.sample_id] = Outcome.TRAINED
                items.append(TrainItem(sample, advantage, 1.0))
            elif config.staleness_mode is StalenessMode.DROP:
                outcomes[sample.sample_id] = Outcome.STALE_DROPPED
            else:
                outcomes[sample.sample_id] = Outcome.DOWNWEIGHTED
                items.append(TrainItem(sample, advantage, config.stale_weight))
    return items, outcomes, lags


@dataclass(frozen=True)
class BatchTensors:
    """Items collated into the rows of a ``TokenBatch`` (packed); every per-token tensor has its
    layout, ``(R, T)``."""

    tokens: TokenBatch
    mask: torch.Tensor  # float, 1 on loss tokens
    behaviour: torch.Tensor  # float
    versions: torch.Tensor  # int64, -1 off loss tokens
    advantages: torch.Tensor  # float, the sample's advantage on each of its tokens
    weights: torch.Tensor  # float, the sample's weight on each of its tokens

    @property
    def loss_tokens(self) -> int:
        return int(self.mask.sum())


PACKED_TOKEN_COST = 1.6
"""Training time per token of a packed row over a padded one (``bench/trainer_step.py``,
SmolLM2 on CPU: 32 samples of 40-52 tokens took 13.1 s packed into 256-token rows, 8.3 s one
per row, for about as many tokens: the block-diagonal mask leaves the fused attention kernel,
and attention grows with the row)."""


def pack(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``row_tokens`` tokens, longest first, each into
    the first row with room (first-fit decreasing); a sample longer than ``row_tokens`` gets a
    row of its own. Rows are padded to the fullest, and a packed token costs more than a padded
    one (``PACKED_TOKEN_COST``), so unless packing saves more than that (lengths alike), it is
    one row per sample: those need no block-diagonal mask."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([i])
            room.append(max(row_tokens - lengths[i], 0))
        else:
            rows[row].append(i)
            room[row] -= lengths[i]
    if layout_cost(lengths, rows) >= len(lengths) * max(lengths):
        return [[i] for i in order]
    return rows


def layout_cost(lengths: list[int], rows: list[list[int]]) -> float:
    """Padded tokens of ``rows`` (indices of ``lengths``), a packed one costing
    ``PACKED_TOKEN_COST``."""
    fullest = max(sum(lengths[i] for i in row) for row in rows)
    return len(rows) * fullest * (PACKED_TOKEN_COST if any(len(r) > 1 for r in rows) else 1.0)


def shared_prefixes(items: list[TrainItem]) -> tuple[tuple[SharedPrefix, ...], int]:
    """With one row per item (in order), the rows that share the tokens before their first loss
    token, by prefix length, and the tokens a backend running each prefix once then computes
    (each length's rows padded to the longest of them; rows sharing nothing padded alike)."""
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    for i, item in enumerate(items):
        s = item.sample
        first = next((t for t, m in enumerate(s.loss_mask) if m and t > 0), None)
        if first is not None:
            by_prefix.setdefault(tuple(s.token_ids[:first]), []).append(i)
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prefix, rows in by_prefix.items():
        if len(rows) > 1:
            by_length.setdefault(len(prefix), []).append(tuple(rows))
    prefixes = tuple(SharedPrefix(n, tuple(groups)) for n, groups in sorted(by_length.items()))
    lengths = [len(i.sample.token_ids) for i in items]
    shared = {r for p in prefixes for r in p.rows}
    alone = [n for i, n in enumerate(lengths) if i not in shared]
    tokens = len(alone) * max(alone, default=0) + sum(
        len(p.groups) * p.length + len(p.rows) * (max(lengths[r] for r in p.rows) - p.length)
        for p in prefixes
    )
    return prefixes, tokens


def collate(items: list[TrainItem], row_tokens: int, share_prefixes: bool = False) -> BatchTensors:
    """``items`` packed into rows of up to ``row_tokens`` tokens (see ``pack``), each row then
    padded to the fullest one; or, with ``share_prefixes`` (the backend runs a shared prefix
    once) and where that computes fewer tokens, one row per item with their shared prefixes."""
    if not items:
        raise BatchError("cannot collate an empty list of samples")
    lengths = [len(i.sample.token_ids) for i in items]
    rows = pack(lengths, row_tokens)
    prefixes: tuple[SharedPrefix, ...] = ()
    if share_prefixes:
        found, tokens = shared_prefixes(items)
        if found and tokens < layout_cost(lengths, rows):
            rows, prefixes = [[i] for i in range(len(items))], found
    shape = (len(rows), max(sum(lengths[i] for i in row) for row in rows))
    ids = torch.zeros(shape, dtype=torch.long)
    positions = torch.arange(shape[1]).repeat(shape[0], 1)  # padding keeps its column: unread
    attention = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape)
    behaviour = torch.zeros(shape)
    versions = torch.full(shape, -1, dtype=torch.long)
    advantages = torch.zeros(shape)
    weights = torch.zeros(shape)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            s, n = items[i].sample, lengths[i]
            at = (r, slice(start, start + n))
            ids[at] = torch.tensor(s.token_ids)
            positions[at] = torch.arange(n)
            attention[at] = 1
            mask[at] = torch.tensor(s.loss_mask, dtype=torch.float32)
            mask[r, start] = 0  # a sample's first token has no context to be predicted from
            behaviour[at] = torch.tensor(s.logprobs, dtype=torch.float32)
            versions[at] = torch.tensor(s.versions)
            advantages[at] = items[i].advantage
            weights[at] = items[i].weight
            start += n
    return BatchTensors(
        tokens=TokenBatch(ids, positions, attention, read=mask > 0, prefixes=prefixes),
        mask=mask,
        behaviour=behaviour,
        versions=versions,
        advantages=advantages,
        weights=weights,
    )


def split(items: list[TrainItem], parts: int) -> list[list[TrainItem]]:
    """``items`` in ``parts`` contiguous chunks of near-equal size (some may be empty)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(items[start:end])
        start = end
    return out
