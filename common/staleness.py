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


def lag(version: int, versions: Iterable[int], loss_mask: Sequence[int] | None = None) -> int:
    """Versions a sample's oldest loss token lags ``version`` (0 without loss tokens, and never
    below 0). ``versions``: its tokens' weight versions; ``loss_mask``: which of them are loss
    tokens (None: all are, as when ``versions`` holds the generated tokens' only)."""
    if loss_mask is not None:
        versions = [v for v, m in zip(versions, loss_mask, strict=True) if m]
    return max(0, version - min(versions, default=version))
