"""Errors of the megatron-core backend's conversion and model building."""

from trainer.exceptions import TrainerError


class MegatronError(TrainerError):
    """Something specific to the megatron-core backend failed."""


class ConversionError(MegatronError):
    """A model or state dict cannot be converted between HF Llama and Megatron GPTModel layout
    (unsupported architecture, missing or unexpected tensors, wrong shapes, uneven shards)."""
