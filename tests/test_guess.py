"""The long-horizon environment ``guess`` (``rollout.agents.guess``): its feedback, reward, turn
cap and latency, its demonstrations, and a whole game through a real gateway (hf worker, tiny
model) recorded token-exact across its turns."""

import itertools
import random
import re
import time
from pathlib import Path

import pytest

from broker.messages import CallRecorded, SessionEnded
from broker.subjects import SESSION_HEADER
from rollout.agents.agents import AgentContext
from rollout.agents.guess import (
    ENV,
    HIGHER,
    LOWER,
    MIN_FOUND,
    NO_GUESS,
    Game,
    demonstration,
    guess_agent,
    guess_reward,
    guess_task,
    guess_tasks,
    question,
)
from rollout.agents.verifiers import bind, first_number
from seamlessflow.config import load_config
from tests.support import MODEL, stream_messages
from trainer.config import LossAggregation
from trajectory.tree import build_session


def test_feedback_points_at_the_secret_and_restates_the_open_range():
    game = Game(9, 1, 16)
    game, said = game.answer(5)
    assert said == f"{HIGHER}: 6-16" and game == Game(9, 6, 16)
    game, said = game.answer(12)
    assert said == f"{LOWER}: 6-11"
    game, said = game.answer(None)
    assert said == f"{NO_GUESS}: 6-11" and game == Game(9, 6, 11)
    game, said = game.answer(3)  # outside the open range: it stays as it was
    assert said == f"{HIGHER}: 6-11"


def test_the_reward_falls_with_the_turns_used_and_is_zero_when_not_found():
    found = [guess_reward(True, turns) for turns in range(1, 13)]
    assert found[:3] == [1.0, 0.9, 0.8]
    assert all(a > b for a, b in itertools.pairwise(found[:10]))
    assert found[-1] == MIN_FOUND > guess_reward(False, 1) == 0.0


def test_tasks_are_generated_in_code_and_verified_by_their_secret():
    rng = random.Random(3)
    tasks = guess_tasks(rng, 50, high=16, group_size=4, max_turns=8, prefix="g", turn_delay_s=0.5)
    assert tasks == guess_tasks(random.Random(3), 50, high=16, group_size=4, max_turns=8,
                                prefix="g", turn_delay_s=0.5)  # fmt: skip
    secrets = {int(t.reward.reference) for t in tasks}
    assert secrets <= set(range(1, 17)) and len(secrets) > 8
    task = tasks[0]
    assert task.messages[0].content == question(16) and task.max_turns == 8
    assert task.metadata["turn_delay_s"] == "0.5"
    verify = bind(task.reward)
    assert verify(f"{task.reward.reference} ") and not verify("0")
    with pytest.raises(ValueError, match=r"not in \[1, 16\]"):
        guess_task("x", 17, high=16, group_size=1, max_turns=8)


def test_demonstrations_guess_within_the_range_the_feedback_leaves_open():
    rng = random.Random(0)
    turns = set()
    for _ in range(500):
        messages, reply = demonstration(rng, 16)
        assert messages[0] == {"role": "user", "content": question(16)}
        low, high = 1, 16
        for said, heard in zip(messages[1::2], messages[2::2], strict=True):
            assert said["role"] == "assistant" and heard["role"] == "user"
            guess = int(said["content"])
            assert low <= guess <= high
            higher = heard["content"].startswith(HIGHER)
            low, high = (guess + 1, high) if higher else (low, guess - 1)
            assert heard["content"] in (f"{HIGHER}: {low}-{high}", f"{LOWER}: {low}-{high}")
        assert low <= int(reply) <= high
        turns.add(len(messages) // 2)
    assert turns == set(range(8))  # histories of 0 to 7 earlier guesses


@pytest.mark.newest_nats
async def test_a_game_through_the_gateway_is_recorded_token_exact_across_its_turns(stack, js, tok):
    """A secret the untrained model will not find: the game runs to its 8-turn cap; the
    environment waits its latency every turn; each call's prompt is the previous call's prompt
    and output ids plus the feedback, so the session is one sample with every guess in its loss
    mask."""
    secret, delay = 999_983, 0.2
    task = guess_task("lh", secret, high=1_000_000, group_size=1, max_turns=8, turn_delay_s=delay)
    sid = f"lh-{time.monotonic_ns()}"
    ctx = AgentContext(
        task=task,
        session_id=sid,
        gateway_url=stack.url,
        client=stack.async_client().with_options(default_headers={SESSION_HEADER: sid}),
        model=MODEL,
        temperature=1.0,
        max_tokens=4,
        verify=bind(task.reward),
    )
    started = time.monotonic()
    result = await guess_agent(ctx)
    elapsed = time.monotonic() - started

    assert result.turns == 8 and not ctx.verify(result.answer)
    assert elapsed >= 7 * delay
    calls = await stream_messages(
        js, stack.names.traj_stream, CallRecorded, subject=stack.names.traj_calls(sid)
    )
    assert len(calls) == 8
    game = Game(secret, 1, 1_000_000)
    for before, after in itertools.pairwise(calls):
        context = before.prompt_ids + before.output_ids
        assert after.prompt_ids[: len(context)] == context  # token-exact: nothing re-tokenized
        reply = tok.decode(before.output_ids, skip_special_tokens=True)
        guess = first_number(reply)
        game, said = game.answer(None if guess is None else int(guess))
        added = tok.decode(after.prompt_ids[len(context) :])
        assert re.search(rf"<\|im_start\|>user\n{said}<\|im_end\|>", added), (reply, added)
    (sample,) = build_session(calls, SessionEnded(session_id=sid, reward=0.0)).samples
    assert sample.token_ids == calls[-1].prompt_ids + calls[-1].output_ids
    assert sum(sample.loss_mask) == sum(len(c.output_ids) for c in calls)


def test_the_example_config_plays_8_turn_games_with_latency():
    config = load_config(Path(__file__).parents[1] / "examples" / "long_horizon.toml")
    assert config.tasks.env == ENV and config.tasks.max_turns >= 8
    assert config.tasks.turn_delay_s > 0
    assert config.trainer.loss_aggregation is LossAggregation.SAMPLE
