"""Trainer backends behind one interface (``trainer.backends.base.TrainerBackend``)."""

import importlib
from pathlib import Path

from common.plugins import announce
from trainer.backends.base import ApplyStats, TokenBatch, TrainerBackend
from trainer.config import TrainerConfig

__all__ = ["ApplyStats", "TokenBatch", "TrainerBackend", "build_backend"]


def build_backend(model: Path, config: TrainerConfig) -> TrainerBackend:
    """The backend ``config.backend`` chooses, loaded from ``model`` (an HF folder); its
    config names its module (``implementation``). A benchmark-only one says so first."""
    announce("trainer backend", config.backend)
    module = importlib.import_module(config.backend.implementation)
    return module.build(model, config)
