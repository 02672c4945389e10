"""A brief supervised warm start: a few hundred SFT steps on an environment's demonstrations, so a
model that knows nothing (the random tiny Llama) answers in the task's format before RL begins.

The result is cached as a model folder keyed by everything that shapes it, so a second run starts
at once. Only the demonstration's answer tokens (up to and including the end-of-turn token) are
trained; the prompt is rendered by the model's own chat template, as the gateway renders it.
"""

import hashlib
import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from common.log import kv
from common.models import load_tokenizer, model_cache_dir, save_model

log = logging.getLogger(__name__)

Demonstration = tuple[list[dict[str, str]], str]
"""Chat messages and the assistant's correct reply."""


class WarmStartConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=0, ge=0, description="SFT steps before RL; 0: no warm start")
    batch_size: int = Field(default=32, ge=1, description="demonstrations per step")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate")
    seed: int = Field(default=0, ge=0)


def warm_start(
    base: Path,
    config: WarmStartConfig,
    demonstrations: Callable[[random.Random], Demonstration],
    key: str,
    *,
    cache: Path | None = None,
) -> Path:
    """The folder of ``base`` after ``config.steps`` SFT steps on ``demonstrations``, built on
    first use. ``key`` names the demonstration source (it is part of the cache key)."""
    if config.steps == 0:
        return base
    digest = hashlib.sha256(
        json.dumps([str(base.resolve()), key, config.model_dump()], sort_keys=True).encode()
    ).hexdigest()[:12]
    target = (cache or model_cache_dir()) / f"{base.name}-warm-{digest}"
    if (target / "config.json").is_file():
        log.info(kv("warm_start_cached", path=target))
        return target
    model, tokenizer = _train(base, config, demonstrations)
    save_model(target, model, tokenizer)
    log.info(kv("warm_start_saved", path=target, steps=config.steps))
    return target


def _train(base: Path, config: WarmStartConfig, demonstrations):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    bar = tqdm(range(config.steps), desc="warm start (SFT)", unit="step", leave=False)
    for _ in bar:
        draws = Counter(
            _tokenize(tokenizer, *demonstrations(rng)) for _ in range(config.batch_size)
        )
        loss = batch_loss(model, draws, tokenizer.pad_token_id or 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model, tokenizer


def batch_loss(model, draws: Counter[tuple[tuple, tuple]], pad_id: int):
    """The mean loss over the answer tokens of a batch of (prompt ids, answer ids) ``draws``, as
    the causal LM's own loss over the batch with each draw repeated. A demonstration drawn
    several times is computed once and weighted by its draws: less work where an environment
    has few distinct demonstrations (the tests' tool model: 6, batches of 8)."""
    import torch

    ids, labels = padded(list(draws), pad_id)
    targets = labels[:, 1:]
    token_losses = torch.nn.functional.cross_entropy(
        model(input_ids=ids).logits[:, :-1].transpose(1, 2), targets, reduction="none"
    )
    weights = torch.tensor(list(draws.values()), dtype=token_losses.dtype)
    return (token_losses.sum(1) @ weights) / ((targets != -100).sum(1).to(weights) @ weights)


def padded(pairs: list[tuple[tuple, tuple]], pad_id: int):
    """(prompt ids, answer ids) pairs as one right-padded batch: the input ids, and labels that
    are the answer's ids where it stands and -100 (no loss) elsewhere."""
    import torch

    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad_id)
    labels = torch.full((len(pairs), width), -100)
    for row, (prompt, answer) in enumerate(pairs):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


def _tokenize(tokenizer, messages: list[dict[str, str]], answer: str) -> tuple[tuple, tuple]:
    """Prompt ids as the gateway renders them, and the reply's ids through the end of turn."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": answer}], tokenize=False
    )
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the reply's prompt differently: cannot SFT")
    reply = full[len(prompt) :]
    if tokenizer.eos_token and tokenizer.eos_token in reply:
        reply = reply[: reply.index(tokenizer.eos_token) + len(tokenizer.eos_token)]

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode(prompt), encode(reply)
