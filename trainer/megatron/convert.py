"""HF Llama <-> megatron-core ``GPTModel`` state dicts, in pure torch (megatron is not imported).

Names and layouts for the full model (TP=1, one pipeline stage), layer ``i``:

==========================================  ==================================================
HF                                          Megatron
==========================================  ==================================================
``model.embed_tokens.weight``               ``embedding.word_embeddings.weight``
``model.layers.i.input_layernorm.weight``   ``decoder.layers.i.input_layernorm.weight``
``self_attn.{q,k,v}_proj.weight``           ``self_attention.linear_qkv.weight``: per query
                                            group ``g`` the rows ``[q heads of g..., k_g, v_g]``
``self_attn.o_proj.weight``                 ``self_attention.linear_proj.weight``
``post_attention_layernorm.weight``         ``pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj.weight``               ``mlp.linear_fc1.weight`` = ``[gate; up]`` (SwiGLU)
``mlp.down_proj.weight``                    ``mlp.linear_fc2.weight``
``model.norm.weight``                       ``decoder.final_layernorm.weight``
``lm_head.weight`` (untied only)            ``output_layer.weight``
==========================================  ==================================================

Both sides rotate queries and keys by halves (``rotate_half``; Megatron's
``rotary_interleaved=False``), so no row permutation is needed. A tied model has no
``lm_head.weight`` on either side (an HF dict that has one must hold the embedding itself).

Tensor parallelism (``shard_tp``/``unshard_tp``) splits column-parallel weights (embedding,
``linear_qkv``, ``output_layer``) into contiguous row blocks, row-parallel weights
(``linear_proj``, ``linear_fc2``) into column blocks, and ``linear_fc1`` into ``[gate_r; up_r]``
per rank; norms are copied to every rank. ``pipeline_stage`` picks one pipeline stage's layers
(renumbered from 0), as megatron-core numbers them inside each stage.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Self

import torch
from torch import Tensor

from trainer.megatron.exceptions import ConversionError

_SUPPORTED_MODEL_TYPES = ("llama", "mistral")
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
"""megatron-core's Llama 3 RoPE scaling hard-codes these (``RotaryEmbedding._apply_scaling``)
and ``original_max_position_embeddings=8192``; only ``factor`` is configurable."""
_LLAMA3_ORIGINAL_CONTEXT = 8192


@dataclass(frozen=True)
class LlamaSpec:
    """The shape and numerics of a Llama-family model, read from its HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int  # HF num_key_value_heads
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool  # tie_word_embeddings
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama 3 RoPE scaling factor; None: plain RoPE
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config: Any) -> Self:
        """From a transformers ``PretrainedConfig``; raises ``ConversionError`` for anything
        megatron-core's local Llama layout cannot represent exactly."""
        model_type = getattr(config, "model_type", None)
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ConversionError(
                f"model_type {model_type!r} is not supported; expected one of "
                f"{', '.join(_SUPPORTED_MODEL_TYPES)}"
            )
        unsupported = {
            "hidden_act": (getattr(config, "hidden_act", "silu"), "silu"),
            "attention_bias": (getattr(config, "attention_bias", False), False),
            "mlp_bias": (getattr(config, "mlp_bias", False), False),
            "sliding_window": (getattr(config, "sliding_window", None), None),
        }
        for field, (value, wanted) in unsupported.items():
            if value != wanted:
                raise ConversionError(
                    f"{model_type} config has {field}={value!r}; only {wanted!r} is supported"
                )
        heads, groups = config.num_attention_heads, config.num_key_value_heads or 0
        if groups <= 0 or heads % groups:
            raise ConversionError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
            )
        theta, factor = _rope(config)
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_query_groups=groups,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied=bool(config.tie_word_embeddings),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=theta,
            rope_scaling_factor=factor,
            max_position_embeddings=config.max_position_embeddings,
        )

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name with its shape (no ``lm_head.weight`` when tied)."""
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self._q_rows, self._kv_rows
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Megatron tensor name of the full model (TP=1, PP=1) with its shape."""
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self._q_rows, self._kv_rows
        shapes = {"embedding.word_embeddings.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"decoder.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attention.linear_qkv.weight": (q + 2 * kv, h),
                p + "self_attention.linear_proj.weight": (h, q),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "mlp.linear_fc1.weight": (2 * f, h),
                p + "mlp.linear_fc2.weight": (h, f),
            }
        shapes["decoder.final_layernorm.weight"] = (h,)
        if not self.tied:
            shapes["output_layer.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def _q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def _kv_rows(self) -> int:
        return self.num_query_groups * self.head_dim


def _rope(config: Any) -> tuple[float, float | None]:
    """(theta, Llama 3 scaling factor or None) from transformers 5 ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = params or dict(getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        fixed = _LLAMA3_ROPE | {"original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT}
        differs = {k: scaling.get(k) for k, v in fixed.items() if scaling.get(k) != v}
        if not differs:
            return theta, float(scaling["factor"])
        raise ConversionError(
            f"llama3 RoPE scaling with {differs} is not supported: megatron-core fixes {fixed}"
        )
    raise ConversionError(f"RoPE type {kind!r} is not supported (only default and llama3)")


def _check(tensors: Mapping[str, Tensor], shapes: dict[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(shapes.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - shapes.keys())
    wrong = [
        f"{k} {tuple(tensors[k].shape)} != {shapes[k]}"
        for k in shapes.keys() & tensors.keys()
        if tuple(tensors[k].shape) != shapes[k]
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
        if items
    ]
    if problems:
        raise ConversionError(f"{what} does not match the model: " + "; ".join(problems))


def hf_to_megatron(hf: Mapping[str, Tensor], spec: LlamaSpec) -> dict[str, Tensor]:
    """The full Megatron state dict of an HF Llama state dict (every tensor checked)."""
    if spec.tied and "lm_head.weight" in hf:
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise ConversionError("tied model's lm_head.weight differs from its embedding")
        hf = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    _check(hf, spec.hf_shapes(), "HF state dict")
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[f"{h}self_attn.{x}_proj.weight"] for x in "qkv")
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out |= {
            m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
            m + "self_attention.linear_qkv.weight": _fuse_qkv(q, k, v, spec),
            m + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
            m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
            m + "mlp.linear_fc1.weight": torch.cat([gate, up]),
            m + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"],
        }
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: Mapping[str, Tensor], spec: LlamaSpec) -> dict[str, Tensor]:
    """The HF Llama state dict of a full Megatron state dict (every tensor checked)."""
    _check(mg, spec.megatron_shapes(), "Megatron state dict")
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"]}
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(mg[m + "self_attention.linear_qkv.weight"], spec)
        gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2)
        out |= {
            h + "input_layernorm.weight": mg[m + "input_layernorm.weight"],
            h + "self_attn.q_proj.weight": q,
            h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": mg[m + "self_attention.linear_proj.weight"],
            h + "post_attention_layernorm.weight": mg[m + "pre_mlp_layernorm.weight"],
            h + "mlp.gate_proj.weight": gate.contiguous(),
            h + "mlp.up_proj.weight": up.contiguous(),
            h + "mlp.down_proj.weight": mg[m + "mlp.linear_fc2.weight"],
        }
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not spec.tied:
        out["lm_head.weight"] = mg["output_layer.weight"]
    return out


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, spec: LlamaSpec) -> Tensor:
    groups, hidden = spec.num_query_groups, spec.hidden_size
    per_group = spec.num_heads // groups
    q = q.reshape(groups, per_group, spec.head_dim, hidden)
    k, v = (x.reshape(groups, 1, spec.head_dim, hidden) for x in (k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _split_qkv(qkv: Tensor, spec: LlamaSpec) -> tuple[Tensor, Tensor, Tensor]:
    groups, hidden = spec.num_query_groups, spec.hidden_size
    per_group = spec.num_heads // groups
    rows = qkv.reshape(groups, per_group + 2, spec.head_dim, hidden)
    q = rows[:, :per_group].reshape(-1, hidden).contiguous()
    k = rows[:, per_group].reshape(-1, hidden).contiguous()
    v = rows[:, per_group + 1].reshape(-1, hidden).contiguous()
    return q, k, v


class _Split(Enum):
    """How tensor parallelism splits one Megatron tensor."""

    COPY = "copy"  # norms: the same tensor on every rank
    ROWS = "rows"  # column-parallel linear / vocab-parallel embedding: dim 0 blocks
    COLUMNS = "columns"  # row-parallel linear: dim 1 blocks
    GATED_ROWS = "gated_rows"  # linear_fc1 = [gate; up]: rank r holds [gate_r; up_r]


_SPLITS = {
    "word_embeddings.weight": _Split.ROWS,
    "linear_qkv.weight": _Split.ROWS,
    "output_layer.weight": _Split.ROWS,
    "linear_proj.weight": _Split.COLUMNS,
    "linear_fc2.weight": _Split.COLUMNS,
    "linear_fc1.weight": _Split.GATED_ROWS,
    "layernorm.weight": _Split.COPY,
}


def _split_of(name: str) -> _Split:
    for suffix, split in _SPLITS.items():
        if name.endswith(suffix):
            return split
    raise ConversionError(f"{name}: no tensor-parallel rule for this Megatron tensor")


def shard_tp(mg: Mapping[str, Tensor], tp_size: int) -> list[dict[str, Tensor]]:
    """Split a Megatron state dict (one pipeline stage) into ``tp_size`` rank dicts."""
    if tp_size < 1:
        raise ConversionError(f"tensor-parallel size must be at least 1, got {tp_size}")
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]
    for name, tensor in mg.items():
        for rank, piece in enumerate(_shard(name, tensor, tp_size)):
            shards[rank][name] = piece
    return shards


def _shard(name: str, tensor: Tensor, n: int) -> list[Tensor]:
    split = _split_of(name)
    if split is _Split.COPY:
        return [tensor] * n
    dim = 1 if split is _Split.COLUMNS else 0
    size = tensor.shape[dim] // (2 if split is _Split.GATED_ROWS else 1)
    if size % n:
        raise ConversionError(
            f"{name}: dim {dim} ({size} per part) does not split into {n} equal shards"
        )
    if split is _Split.GATED_ROWS:
        gate, up = (part.chunk(n) for part in tensor.chunk(2))
        return [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
    return [piece.contiguous() for piece in tensor.chunk(n, dim=dim)]


def unshard_tp(shards: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Join the rank dicts of ``shard_tp`` (or of a TP group's models) into one."""
    if not shards:
        raise ConversionError("no tensor-parallel shards to join")
    names = shards[0].keys()
    for rank, shard in enumerate(shards[1:], start=1):
        if shard.keys() != names:
            raise ConversionError(
                f"tensor-parallel rank {rank} holds other tensors than rank 0: "
                f"{sorted(shard.keys() ^ names)[:4]}"
            )
    return {name: _join(name, [shard[name] for shard in shards]) for name in names}


def _join(name: str, pieces: list[Tensor]) -> Tensor:
    split = _split_of(name)
    if split is _Split.COPY:
        if any(not torch.equal(piece, pieces[0]) for piece in pieces[1:]):
            raise ConversionError(f"{name}: replicated tensor differs between TP ranks")
        return pieces[0]
    if split is _Split.GATED_ROWS:
        gates, ups = zip(*(piece.chunk(2) for piece in pieces), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(pieces, dim=1 if split is _Split.COLUMNS else 0)


def pipeline_stage(
    mg: Mapping[str, Tensor], spec: LlamaSpec, pp_size: int, pp_rank: int
) -> dict[str, Tensor]:
    """One pipeline stage's tensors of a full Megatron state dict, layers renumbered from 0.

    Layers are split evenly, as megatron-core does by default. The first stage holds the
    embedding, the last the final norm and output layer; with tied embeddings and more than one
    stage the last stage holds its own copy of the embedding as ``output_layer.weight``.
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size or spec.num_layers % pp_size:
        raise ConversionError(
            f"pipeline stage {pp_rank} of {pp_size}: {spec.num_layers} layers must split "
            "evenly into at least one stage"
        )
    if pp_size == 1:
        return dict(mg)
    per_stage = spec.num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = mg["embedding.word_embeddings.weight"]
    for local in range(per_stage):
        src = f"decoder.layers.{pp_rank * per_stage + local}."
        for name, tensor in mg.items():
            if name.startswith(src):
                out[f"decoder.layers.{local}." + name.removeprefix(src)] = tensor
    if last:
        out["decoder.final_layernorm.weight"] = mg["decoder.final_layernorm.weight"]
        out["output_layer.weight"] = mg[
            "embedding.word_embeddings.weight" if spec.tied else "output_layer.weight"
        ]
    return out
