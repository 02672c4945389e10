"""A megatron-core ``GPTModel`` for a Llama-family HF config, and HF weights loaded into it.

The model uses megatron-core's local layer spec (no Transformer Engine): RMSNorm, SwiGLU
(``gated_linear_unit``), RoPE with the HF config's theta, no biases, grouped-query attention.
Parameters are created on the CPU (``use_cpu_initialization``) and left uninitialised: every one
is overwritten by ``load_hf_weights``. Building works on any machine; megatron-core's forward
pass needs CUDA (its rotary embedding moves itself to ``torch.cuda.current_device()``).

megatron-core is imported inside the functions: importing it takes several seconds.
"""

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from common.log import kv
from trainer.megatron.convert import LlamaSpec, hf_to_megatron, pipeline_stage, shard_tp
from trainer.megatron.exceptions import ConversionError, MegatronError

log = logging.getLogger(__name__)

EXTRA_STATE = "_extra_state"
"""Suffix of the (empty, ``None``) extra-state entries megatron-core's linear layers add to
their state dicts; they hold no weights and are left out of every tensor dict here."""


class ParallelConfig(BaseModel):
    """How the model is split over ranks; data parallelism takes the remaining ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel: int = Field(default=1, ge=1, le=64, description="tensor-parallel ranks")
    pipeline_parallel: int = Field(default=1, ge=1, le=64, description="pipeline stages")


@contextmanager
def megatron_parallel(parallel: ParallelConfig) -> Iterator[None]:
    """megatron-core's ``parallel_state`` for the duration of the block, torn down after.

    Uses the default ``torch.distributed`` group when one is initialised; otherwise creates a
    single-process gloo group (an in-memory store, no port) and destroys it on exit.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        raise MegatronError("megatron-core parallel_state is already initialised in this process")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.get_world_size()
        ranks = parallel.tensor_parallel * parallel.pipeline_parallel
        if world % ranks:
            raise MegatronError(
                f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel "
                f"= {ranks}"
            )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        if own_group:
            dist.destroy_process_group()


def transformer_config(spec: LlamaSpec, parallel: ParallelConfig, dtype: torch.dtype) -> Any:
    """megatron-core's ``TransformerConfig`` for ``spec`` (no dropout, no fusions)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def build_gpt_model(
    spec: LlamaSpec, parallel: ParallelConfig, dtype: torch.dtype = torch.float32
) -> Any:
    """This rank's ``GPTModel`` (its pipeline stage, its tensor-parallel shard), on the CPU.

    Needs ``megatron_parallel(parallel)`` (or an equivalent ``parallel_state``) around it. The
    logits are gathered over tensor-parallel ranks (``parallel_output=False``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not parallel_state.model_parallel_is_initialized():
        raise MegatronError(
            "megatron-core parallel_state is not initialised: build the model "
            "inside megatron_parallel()"
        )
    sizes = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if sizes != (parallel.tensor_parallel, parallel.pipeline_parallel):
        raise MegatronError(f"parallel_state has (tp, pp) = {sizes}, the config asks {parallel}")
    model = GPTModel(
        config=transformer_config(spec, parallel, dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=spec.tied,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    log.info(
        kv("megatron_model_built", layers=spec.num_layers, tp=sizes[0], pp=sizes[1], dtype=dtype)
    )
    return model


def megatron_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's state dict without megatron-core's empty extra-state entries."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith(EXTRA_STATE)}


def load_megatron_tensors(model: torch.nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into ``model``: names and shapes must match its tensors exactly."""
    own = megatron_tensors(model)
    missing, unexpected = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own)
    wrong = [
        f"{k} {tuple(tensors[k].shape)} != {tuple(own[k].shape)}"
        for k in own.keys() & tensors.keys()
        if tensors[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        raise ConversionError(
            f"weights do not fit the GPTModel: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, shapes {wrong[:4]}"
        )
    result = model.load_state_dict(dict(tensors), strict=False)
    left = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
    if left or result.unexpected_keys:
        raise ConversionError(f"GPTModel did not load {left[:4]} {result.unexpected_keys[:4]}")


def rank_weights(hf: Mapping[str, Tensor], spec: LlamaSpec) -> dict[str, Tensor]:
    """This rank's Megatron tensors (pipeline stage, tensor-parallel shard) of HF weights."""
    from megatron.core import parallel_state

    stage = pipeline_stage(
        hf_to_megatron(hf, spec),
        spec,
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    shards = shard_tp(stage, parallel_state.get_tensor_model_parallel_world_size())
    return shards[parallel_state.get_tensor_model_parallel_rank()]


def load_hf_weights(model: torch.nn.Module, hf: Mapping[str, Tensor], spec: LlamaSpec) -> None:
    """Load an HF Llama state dict into this rank's ``GPTModel``."""
    load_megatron_tensors(model, rank_weights(hf, spec))


def gather_tp(tensors: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
    """Every tensor-parallel rank's ``tensors`` (the same names on each), on every rank: the
    input of ``convert.unshard_tp``. A collective: every rank of the TP group calls it."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    ranks: list[dict[str, Tensor]] = [{} for _ in range(size)]
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(pieces, tensor, group=group)
        for rank, piece in enumerate(pieces):
            ranks[rank][name] = piece
    return ranks
