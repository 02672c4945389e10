"""The policy's expected reward on the ``guess`` env, measured apart from training: ``games``
games played in-process by a model folder (the run's start) or a trainer checkpoint (its end),
sampled at the training temperature, every game in lockstep (one batched ``generate`` per
turn), scored by the env's own ``Game`` and ``episode_reward``.

Why beside the training curve: the curve scores a session at the newest version among its
tokens, so with episodes spanning versions its first versions collect the quick (high-reward)
games and the long failures land later, and each version's mean is over about 32 sessions. The
same secrets played by the start and the end policy give the change with a standard error of
about 0.015 at 400 games.

The prompts are rendered by the model's chat template from the messages, as the warm start
renders them; the gateway instead appends each turn to the previous call's prompt and output
ids, which for these short numeric replies gives the same text.

Usage: python -m bench.guess_play --model DIR [--checkpoint FILE] [--games 400] [--high 16]
"""

import argparse
import random
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.models import load_tokenizer
from rollout.agents.guess import Game, episode_reward, parse_guess, question
from trainer import checkpoint

SEED = 1234
"""The secrets and the sampling: the same for every policy played."""


def policy(model_dir: Path, checkpoint_file: Path | None = None):
    """The model of ``model_dir``, with a trainer checkpoint's weights when given."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if checkpoint_file is not None:
        model.load_state_dict(checkpoint.load_file(checkpoint_file).backend["model"])
    return model.eval()


@torch.no_grad()
def play(
    model,
    tokenizer,
    games: int,
    *,
    high: int,
    max_turns: int,
    max_tokens: int,
    temperature: float,
) -> dict[str, float]:
    """Mean reward, found rate, in-range fraction and turns over ``games`` games."""
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    state = [Game(rng.randint(1, high), 1, high) for _ in range(games)]
    chats = [[{"role": "user", "content": question(high)}] for _ in range(games)]
    turns, in_range, found = [0] * games, [0] * games, [False] * games
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for _ in range(max_turns):
        live = [i for i in range(games) if not found[i] and turns[i] < max_turns]
        if not live:
            break
        texts = [
            tokenizer.apply_chat_template(chats[i], add_generation_prompt=True, tokenize=False)
            for i in live
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            max_new_tokens=max_tokens,
            pad_token_id=pad,
        )
        replies = tokenizer.batch_decode(
            out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )
        for i, reply in zip(live, replies, strict=True):
            guess = parse_guess(reply)
            turns[i] += 1
            in_range[i] += state[i].open(guess)
            if guess == state[i].secret:
                found[i] = True
                continue
            state[i], said = state[i].answer(guess)
            chats[i] += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": said},
            ]
    rewards = [episode_reward(found[i], turns[i], in_range[i]) for i in range(games)]
    return {
        "games": games,
        "reward": sum(rewards) / games,
        "reward_se": statistics.stdev(rewards) / games**0.5,
        "found": sum(found) / games,
        "in_range": sum(in_range[i] / turns[i] for i in range(games)) / games,
        "turns": sum(turns) / games,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="the start's model folder")
    parser.add_argument("--checkpoint", type=Path, help="a trainer checkpoint of that model")
    parser.add_argument("--games", type=int, default=400)
    parser.add_argument("--high", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    result = play(
        policy(args.model, args.checkpoint),
        load_tokenizer(args.model),
        args.games,
        high=args.high,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )
    print(" ".join(f"{k} {v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
