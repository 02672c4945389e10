"""Trainer backends behind one interface (``trainer.backends.base.TrainerBackend``)."""

import importlib
from pathlib import Path

from trainer.backends.base import ApplyStats, TokenBatch, TrainerBackend
from trainer.config import TrainerConfig

__all__ = ["ApplyStats", "TokenBatch", "TrainerBackend", "build_backend"]


def build_backend(model: Path, config: TrainerConfig) -> TrainerBackend:
    """The backend ``config.backend`` chooses, loaded from ``model`` (an HF folder)."""
    module = importlib.import_module(f"trainer.backends.{config.backend.kind}")
    return module.build(model, config)
