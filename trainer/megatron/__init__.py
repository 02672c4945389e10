"""The megatron-core side of the trainer: HF Llama <-> Megatron ``GPTModel`` weight conversion
(``convert``, pure torch), building the model under megatron-core's parallel state (``model``)
and a GPU check against the HF model (``python -m trainer.megatron.check``). The backend itself
is ``trainer.backends.megatron``. Importing this package does not import megatron-core.
"""

from trainer.megatron.convert import (
    LlamaSpec,
    hf_to_megatron,
    megatron_to_hf,
    pipeline_stage,
    shard_tp,
    unshard_tp,
)
from trainer.megatron.exceptions import ConversionError, MegatronError
from trainer.megatron.model import ParallelConfig

__all__ = [
    "ConversionError",
    "LlamaSpec",
    "MegatronError",
    "ParallelConfig",
    "hf_to_megatron",
    "megatron_to_hf",
    "pipeline_stage",
    "shard_tp",
    "unshard_tp",
]
