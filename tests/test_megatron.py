"""The megatron-core backend: HF Llama <-> GPTModel conversion on a real megatron-core model
(built on the CPU), tensor-parallel sharding, pipeline stages, errors, and the CUDA-only parts.

Two real models: the tiny Llama (tied embeddings, 4 query heads in 2 groups) and an untied
variant with 8 query heads in 2 groups and a non-default RoPE theta.
"""

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from trainer.backends import build_backend
from trainer.config import MegatronBackendConfig, TrainerConfig
from trainer.exceptions import BackendError
from trainer.megatron import (
    ConversionError,
    LlamaSpec,
    ParallelConfig,
    hf_to_megatron,
    megatron_to_hf,
    pipeline_stage,
    shard_tp,
    unshard_tp,
)
from trainer.megatron.check import build_untied_gqa_model

NO_CUDA = "megatron-core's forward pass needs CUDA and this machine has none"


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_untied_gqa_model(tmp_path_factory.mktemp("untied") / "model", seed=1)


@pytest.fixture(params=["tied", "untied"])
def folder(request: pytest.FixtureRequest, tiny_model_dir: Path, untied_dir: Path) -> Path:
    return tiny_model_dir if request.param == "tied" else untied_dir


def read(folder: Path) -> tuple[LlamaSpec, dict[str, torch.Tensor]]:
    return LlamaSpec.from_hf_config(AutoConfig.from_pretrained(folder)), load_file(
        folder / "model.safetensors"
    )


def assert_identical(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Same names, shapes, dtypes and values, tensor by tensor."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def megatron_tp1() -> Iterator[None]:
    """megatron-core's parallel state for TP=PP=DP=1 (a one-process gloo group), torn down after
    this module so nothing leaks into other tests."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra megatron)")
    from trainer.megatron.model import megatron_parallel

    with megatron_parallel(ParallelConfig()):
        yield
    assert not torch.distributed.is_initialized()


def loaded_gpt_model(folder: Path, parallel: ParallelConfig | None = None):
    from trainer.megatron.model import build_gpt_model, load_hf_weights

    spec, hf = read(folder)
    model = build_gpt_model(spec, parallel or ParallelConfig())
    load_hf_weights(model, hf, spec)
    return spec, hf, model


def test_spec_reads_both_configs(tiny_model_dir: Path, untied_dir: Path) -> None:
    tied, _ = read(tiny_model_dir)
    untied, _ = read(untied_dir)
    assert (tied.tied, tied.num_heads, tied.num_query_groups, tied.head_dim) == (True, 4, 2, 64)
    assert (untied.tied, untied.num_heads, untied.num_query_groups) == (False, 8, 2)
    assert (untied.head_dim, untied.rope_theta, untied.rms_norm_eps) == (32, 50000.0, 1e-5)


def test_round_trip_through_a_real_gpt_model(megatron_tp1, folder: Path) -> None:
    from trainer.megatron.model import megatron_tensors

    spec, hf, model = loaded_gpt_model(folder)
    loaded = megatron_tensors(model)
    assert_identical(loaded, hf_to_megatron(hf, spec))
    assert_identical(megatron_to_hf(loaded, spec), hf)
    assert ("output_layer.weight" in loaded) is not spec.tied


def test_gpt_model_layers_read_the_weights_as_hf_does(megatron_tp1, folder: Path) -> None:
    """megatron-core's own QKV split, SwiGLU MLP, RMSNorms and RoPE frequencies (the parts that
    run on the CPU) against the HF model's, layer by layer."""
    spec, _, model = loaded_gpt_model(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.randn(5, 3, spec.hidden_size, generator=torch.Generator().manual_seed(0))  # [s,b,h]
    xb = x.transpose(0, 1)  # HF: [b, s, h]

    def heads(t: torch.Tensor) -> torch.Tensor:  # HF [b, s, n*d] -> Megatron [s, b, n, d]
        return t.view(*t.shape[:2], -1, spec.head_dim).transpose(0, 1)

    close = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for layer, want in zip(model.decoder.layers, ref.model.layers, strict=True):
            q, k, v = layer.self_attention.get_query_key_value_tensors(x, None)
            torch.testing.assert_close(q, heads(want.self_attn.q_proj(xb)), **close)
            torch.testing.assert_close(k, heads(want.self_attn.k_proj(xb)), **close)
            torch.testing.assert_close(v, heads(want.self_attn.v_proj(xb)), **close)
            out, bias = layer.mlp(x)
            assert bias is None
            torch.testing.assert_close(out, want.mlp(xb).transpose(0, 1), **close)
            torch.testing.assert_close(
                layer.input_layernorm(x), want.input_layernorm(xb).transpose(0, 1), **close
            )
            torch.testing.assert_close(
                layer.pre_mlp_layernorm(x),
                want.post_attention_layernorm(xb).transpose(0, 1),
                **close,
            )
        torch.testing.assert_close(
            model.decoder.final_layernorm(x), ref.model.norm(xb).transpose(0, 1), **close
        )
        torch.testing.assert_close(model.rotary_pos_emb.inv_freq, ref.model.rotary_emb.inv_freq)


def _tp_rank(rank: int, world: int, store: str, folder: str) -> None:
    """One rank of a real TP=``world`` GPTModel on gloo (run by ``torch.multiprocessing``)."""
    from trainer.megatron.model import gather_tp, megatron_parallel, megatron_tensors

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        with megatron_parallel(ParallelConfig(tensor_parallel=world)):
            spec, hf, model = loaded_gpt_model(Path(folder), ParallelConfig(tensor_parallel=world))
            assert_identical(
                unshard_tp(gather_tp(megatron_tensors(model))), hf_to_megatron(hf, spec)
            )
            ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.layers[0]
            layer = model.decoder.layers[0]
            x = torch.randn(4, 2, spec.hidden_size, generator=torch.Generator().manual_seed(0))
            xb = x.transpose(0, 1)
            heads = spec.num_heads // world
            with torch.no_grad():
                q = layer.self_attention.get_query_key_value_tensors(x, None)[0]
                want = ref.self_attn.q_proj(xb).view(2, 4, spec.num_heads, spec.head_dim)
                want = want[:, :, rank * heads : (rank + 1) * heads].transpose(0, 1)
                torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-5)
                # Row-parallel linear_fc2 all-reduces the partial sums of every rank.
                out, _ = layer.mlp(x)
                torch.testing.assert_close(out, ref.mlp(xb).transpose(0, 1), rtol=1e-5, atol=1e-5)
    finally:
        torch.distributed.destroy_process_group()


def test_tensor_parallel_gpt_model_takes_the_shards(untied_dir: Path, tmp_path: Path) -> None:
    """Two gloo ranks build a real TP=2 GPTModel: each loads its ``shard_tp`` shard with strict
    names and shapes, its attention sees its own query heads, the TP MLP output equals HF's, and
    the gathered shards join back into the full model."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra megatron)")
    store = f"file://{tmp_path / 'store'}"
    torch.multiprocessing.spawn(_tp_rank, args=(2, store, str(untied_dir)), nprocs=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_round_trip(folder: Path, tp: int) -> None:
    spec, hf = read(folder)
    full = hf_to_megatron(hf, spec)
    shards = shard_tp(full, tp)
    assert len(shards) == tp
    assert_identical(unshard_tp(shards), full)
    for shard in shards:
        for name, tensor in shard.items():
            if tensor.dim() == 2:  # every matrix is split, norms are copied
                assert tensor.numel() * tp == full[name].numel(), name


def test_tensor_parallel_rank_holds_its_heads_and_gate_up_rows(folder: Path) -> None:
    """TP=2, 2 query groups: rank r holds query group r ([its q heads, k_r, v_r]), rows r of the
    gate and of the up projection, columns r of o_proj and down_proj, vocab rows r."""
    spec, hf = read(folder)
    shards = shard_tp(hf_to_megatron(hf, spec), 2)
    q_rows = spec.num_heads // 2 * spec.head_dim
    f_rows, vocab_rows = spec.ffn_hidden_size // 2, spec.vocab_size // 2
    for r, shard in enumerate(shards):
        h, m = "model.layers.1.", "decoder.layers.1."

        def rows(name: str, n: int, r: int = r) -> torch.Tensor:
            return hf[name][r * n : (r + 1) * n]

        qkv = torch.cat(
            [
                rows(h + "self_attn.q_proj.weight", q_rows),
                rows(h + "self_attn.k_proj.weight", spec.head_dim),
                rows(h + "self_attn.v_proj.weight", spec.head_dim),
            ]
        )
        assert torch.equal(shard[m + "self_attention.linear_qkv.weight"], qkv)
        gate_up = torch.cat(
            [rows(h + "mlp.gate_proj.weight", f_rows), rows(h + "mlp.up_proj.weight", f_rows)]
        )
        assert torch.equal(shard[m + "mlp.linear_fc1.weight"], gate_up)
        o_cols = hf[h + "self_attn.o_proj.weight"].chunk(2, dim=1)[r]
        assert torch.equal(shard[m + "self_attention.linear_proj.weight"], o_cols)
        down_cols = hf[h + "mlp.down_proj.weight"].chunk(2, dim=1)[r]
        assert torch.equal(shard[m + "mlp.linear_fc2.weight"], down_cols)
        embedding = rows("model.embed_tokens.weight", vocab_rows)
        assert torch.equal(shard["embedding.word_embeddings.weight"], embedding)
        assert torch.equal(shard[m + "input_layernorm.weight"], hf[h + "input_layernorm.weight"])


def test_unshard_refuses_replicas_that_differ(tiny_model_dir: Path) -> None:
    spec, hf = read(tiny_model_dir)
    shards = shard_tp(hf_to_megatron(hf, spec), 2)
    name = "decoder.layers.0.input_layernorm.weight"
    shards[1][name] = shards[1][name] + 1
    with pytest.raises(ConversionError, match=name):
        unshard_tp(shards)


def test_pipeline_stages_split_layers_evenly(folder: Path) -> None:
    spec, hf = read(folder)
    full = hf_to_megatron(hf, spec)
    first, last = (pipeline_stage(full, spec, 2, rank) for rank in (0, 1))
    half = spec.num_layers // 2
    qkv = "self_attention.linear_qkv.weight"
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert (
        "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    )
    assert torch.equal(last[f"decoder.layers.0.{qkv}"], full[f"decoder.layers.{half}.{qkv}"])
    assert f"decoder.layers.{half}.{qkv}" not in last
    output = full["embedding.word_embeddings.weight" if spec.tied else "output_layer.weight"]
    assert torch.equal(last["output_layer.weight"], output)
    layer_tensors = [sum(k.startswith("decoder.layers.") for k in d) for d in (first, last, full)]
    assert layer_tensors[0] == layer_tensors[1] == layer_tensors[2] // 2
    with pytest.raises(ConversionError, match="split evenly"):
        pipeline_stage(full, spec, 3, 0)


def test_conversion_names_what_is_wrong(tiny_model_dir: Path) -> None:
    spec, hf = read(tiny_model_dir)
    missing = {k: v for k, v in hf.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ConversionError, match=r"missing \(1\): model.layers.2.mlp.up_proj"):
        hf_to_megatron(missing, spec)
    wrong = hf | {"model.norm.weight": torch.ones(7)}
    with pytest.raises(ConversionError, match=r"model.norm.weight \(7,\) != \(256,\)"):
        hf_to_megatron(wrong, spec)
    extra = hf | {"model.layers.9.input_layernorm.weight": torch.ones(256)}
    with pytest.raises(ConversionError, match="unexpected"):
        hf_to_megatron(extra, spec)
    untied_head = hf | {"lm_head.weight": torch.zeros_like(hf["model.embed_tokens.weight"])}
    with pytest.raises(ConversionError, match=r"lm_head\.weight differs"):
        hf_to_megatron(untied_head, spec)
    same_head = hf | {"lm_head.weight": hf["model.embed_tokens.weight"].clone()}
    assert_identical(hf_to_megatron(same_head, spec), hf_to_megatron(hf, spec))
    with pytest.raises(ConversionError, match="does not split into 3 equal shards"):
        shard_tp(hf_to_megatron(hf, spec), 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "RoPE type 'linear'"),
        (
            dict(
                max_position_embeddings=16384,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
            "low_freq_factor",
        ),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **change)
    with pytest.raises(ConversionError, match=message):
        LlamaSpec.from_hf_config(config)


def test_llama3_rope_scaling_is_read() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=scaling)
    spec = LlamaSpec.from_hf_config(config)
    assert (spec.rope_theta, spec.rope_scaling_factor) == (500000.0, 32.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_backend_without_cuda_says_why(tiny_model_dir: Path) -> None:
    with pytest.raises(BackendError, match="megatron backend needs a CUDA GPU"):
        build_backend(tiny_model_dir, TrainerConfig(backend=MegatronBackendConfig()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit status without CUDA")
def test_gpu_check_script_without_cuda_says_why(capsys: pytest.CaptureFixture) -> None:
    from trainer.megatron.check import main

    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_megatron_backend_matches_the_torch_backend(folder: Path) -> None:
    """Logits, logprobs, gradients and one AdamW step, megatron vs torch backend, on CUDA."""
    from trainer.megatron.check import compare

    rows = compare(folder.name, folder)
    assert rows and all(row.ok for row in rows), rows
