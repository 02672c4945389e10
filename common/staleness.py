"""One staleness rule for the trainer, the run's progress line and the simulator.

A sample's lag is the trainer's version minus the oldest version among its loss tokens (the
generated ones; prompt tokens are not trained on and do not count). That is what the trainer's
``max_staleness`` bounds, and ``StalenessMode`` says what a sample past it gets.
"""

from collections.abc import Iterable, Sequence
from enum import StrEnum


class StalenessMode(StrEnum):
    """What happens to a sample whose tokens lag the trainer by more than ``max_staleness``."""

    DROP = "drop"
    DOWNWEIGHT = "downweight"


def oldest(versions: Iterable[int], loss_mask: Sequence[int] | None = None) -> int | None:
    """The version of a sample's oldest loss token, None without loss tokens. ``versions``: its
    tokens' weight versions; ``loss_mask``: which of them are loss tokens (None: all are, as when
    ``versions`` holds the generated tokens' only)."""
    if loss_mask is not None:
        versions = [v for v, m in zip(versions, loss_mask, strict=True) if m]
    return min(versions, default=None)


def lag(version: int, versions: Iterable[int], loss_mask: Sequence[int] | None = None) -> int:
    """Versions a sample's oldest loss token (``oldest``) lags ``version`` (0 without loss
    tokens, and never below 0)."""
    first = oldest(versions, loss_mask)
    return 0 if first is None else max(0, version - first)
