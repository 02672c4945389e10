"""The long-horizon environment ``guess`` (``rollout.agents.guess``): its feedback, reward (found,
how fast, and guesses within the open range), turn cap and latency, its demonstrations, and a
whole game through a real gateway (hf worker, tiny model) recorded token-exact across its
turns."""

import itertools
import random
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from openai.types.chat import ChatCompletionMessage

from broker.messages import CallRecorded, SessionEnded
from broker.subjects import SESSION_HEADER
from rollout.agents.agents import AgentContext
from rollout.agents.guess import (
    ENV,
    HIGHER,
    IN_RANGE_WEIGHT,
    LOWER,
    MIN_FOUND,
    NO_GUESS,
    Game,
    demonstration,
    episode_reward,
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


def test_the_episode_reward_also_credits_guesses_within_the_open_range():
    assert episode_reward(True, 1, 1) == 1.0
    assert episode_reward(True, 3, 3) == pytest.approx(0.9)  # 0.5 * 0.8 + 0.5 * 3/3
    # Games not won: the more guesses used the feedback, the more reward (found-only: all 0.0).
    lost = [episode_reward(False, 8, k) for k in range(9)]
    assert lost[0] == 0.0 and lost[8] == IN_RANGE_WEIGHT
    assert all(a < b for a, b in itertools.pairwise(lost))
    # Found late with every guess in range beats found late with guesses wasted outside it.
    assert episode_reward(True, 6, 6) > episode_reward(True, 6, 2)
    every = [episode_reward(f, t, k) for f in (True, False) for t in range(1, 13)
             for k in range(t + 1)]  # fmt: skip
    assert min(every) == 0.0 and max(every) == 1.0
    with pytest.raises(ValueError, match="3 guesses in range out of 2"):
        episode_reward(False, 2, 3)


class ScriptedModel:
    """A client whose model replies ``replies`` in order, one per call."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = iter(replies)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **_: object) -> SimpleNamespace:
        message = ChatCompletionMessage(role="assistant", content=next(self.replies))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def scripted(secret: int, replies: list[str], max_turns: int = 8) -> AgentContext:
    task = guess_task("t", secret, high=16, group_size=1, max_turns=max_turns)
    return AgentContext(
        task=task,
        session_id="s",
        gateway_url="http://unused/v1",
        client=ScriptedModel(replies),  # type: ignore[arg-type]
        model=MODEL,
        temperature=1.0,
        max_tokens=4,
        verify=bind(task.reward),
    )


async def test_the_agent_scores_its_game_by_the_guesses_in_the_open_range():
    # 5 (in 1-16), 3 (out of 6-16), no number (out), 12 (in 6-16), 9 (in 6-11: found).
    result = await guess_agent(scripted(9, ["5", "3", "hm", "12", "9"]))
    assert result.answer == "9" and result.turns == 5
    assert result.metrics == {"found": 1.0, "in_range": 0.6}
    assert result.reward == pytest.approx(0.5 * 0.6 + 0.5 * 0.6)
    # Not found: 8 (in 1-16), then 8 twice (out of 9-16); the last guess, unanswered, counts.
    result = await guess_agent(scripted(9, ["8", "8", "8"], max_turns=3))
    assert result.turns == 3 and result.metrics == {"found": 0.0, "in_range": pytest.approx(1 / 3)}
    assert result.reward == pytest.approx(0.5 / 3, abs=1e-6)
    result = await guess_agent(scripted(9, ["8", "12", "10"], max_turns=3))
    assert result.metrics["in_range"] == 1.0 and result.reward == IN_RANGE_WEIGHT


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
async def test_a_game_through_the_gateway_is_recorded_token_exact_across_its_turns(
    stack, js, tok, openai_client
):
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
        client=openai_client(stack.url).with_options(default_headers={SESSION_HEADER: sid}),
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
