"""Two roles of one policy in one session (``rollout.agents.multi_agent``): a solver and a checker
call a real gateway (hf worker, tiny model) under the same session id; a real trajectory manager
turns each session's tree into samples, one per branch.

The expected samples are worked out here from the call records alone, without the tree code:
a leaf is a call's path (prompt + output) that is no prefix of another call's path, and a token
(a prefix of some path) is generated iff the first call, in stream order, whose path holds that
prefix had it among its output tokens.
"""

import random
from pathlib import Path

import pytest

from rollout.agents.arithmetic import arithmetic_reward, arithmetic_tasks
from rollout.agents.multi_agent import (
    CHECK_PROMPT,
    CHECKER_SYSTEM,
    FEEDBACK,
    agrees,
    checker_messages,
)
from rollout.agents.verifiers import last_number
from seamlessflow.config import load_config
from tests.test_agents import calls, unique
from tests.tool_sessions import run_sessions

AGENT = "rollout.agents.multi_agent:solver_checker"
EXAMPLE = Path(__file__).parents[1] / "examples" / "multi_agent.toml"


def test_the_checker_accepts_an_answer_that_ends_in_its_own_result():
    assert agrees("3+4=7", "7") and agrees("7", "so 7")
    assert not agrees("3+4=8", "7") and not agrees("no idea", "7") and not agrees("7", "")
    (system, user) = checker_messages("3+4=", "7")
    assert system == {"role": "system", "content": CHECKER_SYSTEM}
    assert user["content"] == CHECK_PROMPT.format(question="3+4=", answer="7")


def test_the_example_config_runs_the_multi_agent_on_arithmetic():
    config = load_config(EXAMPLE)
    assert config.agents.agent == AGENT and config.tasks.env == "arithmetic"
    assert config.trainer.temperature == config.agents.temperature


def role(tok, token_ids: list[int]) -> str:
    """A conversation's role: the checker's opens with its system prompt; the solver's is the
    task's (one user message, ``a+b=``)."""
    text = tok.decode(token_ids)
    if text.startswith(f"<|im_start|>system\n{CHECKER_SYSTEM}<|im_end|>"):
        return "checker"
    assert text.startswith("<|im_start|>user\n") and CHECKER_SYSTEM not in text, text
    return "solver"


@pytest.mark.newest_nats
async def test_each_roles_branch_becomes_its_own_sample(stack, js, tok):
    names = stack.names
    tasks = arithmetic_tasks(
        random.Random(5), 2, max_operand=9, group_size=2, max_turns=2, prefix=unique("ma")
    )
    by_task = {t.task_id: t for t in tasks}
    sessions, samples = await run_sessions(js, stack, tasks, 4, agent=AGENT)
    two_turns = 0
    for s in sessions:
        task = by_task[s.task_id]
        assert "failed" not in s.metrics and "unscored" not in s.metrics, s.metrics
        assert (s.group_id, s.group_size) == (task.task_id, 2)
        recorded = await calls(js, names, s.session_id)
        # Both roles called under the attempt's one session id, solver then checker, per turn.
        roles = [role(tok, c.prompt_ids) for c in recorded]
        turns = int(s.metrics["turns"])
        assert roles == ["solver", "checker"] * turns and len(recorded) == s.metrics["calls"]
        assert all(c.output_ids for c in recorded)
        outputs = [tok.decode(c.output_ids, skip_special_tokens=True) for c in recorded]
        answers, checks = outputs[0::2], outputs[1::2]
        # The checker saw the solver's answer (as prompt text); it rejected all but the last.
        for call, answer in zip(recorded[1::2], answers, strict=True):
            text = tok.decode(call.prompt_ids)
            # (the reply the agent got leaves out an incomplete UTF-8 character at its end)
            assert "Proposed answer: " + answer.rstrip("\ufffd") in text
            assert text.count("<|im_start|>") == 3  # its own history: system, user, its turn
        assert not any(agrees(c, a) for c, a in zip(checks[:-1], answers[:-1], strict=True))
        assert turns == task.max_turns or agrees(checks[-1], answers[-1])
        if turns == 2:
            two_turns += 1
            first, again = recorded[0].prompt_ids, recorded[2].prompt_ids  # the solver goes on
            assert again[: len(first)] == first and FEEDBACK in tok.decode(again[len(first) :])
        # One shared reward: the env's, for the solver's final answer.
        right = last_number(answers[-1], task.reward.reference)
        assert s.reward == arithmetic_reward(right, turns)

        # The samples: one per leaf of the session's tree, i.e. per distinct branch.
        paths = [(*c.prompt_ids, *c.output_ids) for c in recorded]
        leaves = {p for p in paths if not any(q != p and q[: len(p)] == p for q in paths)}
        labels: dict[tuple[int, ...], tuple[bool, float, int]] = {}
        for c, path in zip(recorded, paths, strict=True):
            n = len(c.prompt_ids)
            for j in range(len(path)):
                label = (False, 0.0, -1)  # a prompt token
                if j >= n:
                    label = (True, c.output_logprobs[j - n], c.output_versions[j - n])
                labels.setdefault(path[: j + 1], label)
        mine = [x for x in samples if x.session_id == s.session_id]
        assert len(mine) == len(leaves) and {tuple(x.token_ids) for x in mine} == leaves
        checker_paths = {p for p, r in zip(paths, roles, strict=True) if r == "checker"} & leaves
        assert [role(tok, x.token_ids) for x in mine].count("checker") == len(checker_paths)
        masked: list[tuple[int, ...]] = []
        for x in mine:
            assert (x.group_id, x.group_size, x.task_id) == (task.task_id, 2, task.task_id)
            assert (x.reward, x.session_samples) == (s.reward, len(mine))
            leaf = tuple(x.token_ids)
            # The other role's prompt never leaks into a branch: the solver's holds nothing of
            # the checker's (``role``); the checker's prompt is its system prompt and one user
            # message, none of the solver's turns or feedback.
            if role(tok, x.token_ids) == "solver":
                assert "Proposed answer:" not in tok.decode(x.token_ids)
            for j, bit in enumerate(x.loss_mask):
                generated, logprob, version = labels[tuple(x.token_ids[: j + 1])]
                if bit:  # a loss token: generated here, with its behaviour logprob and version
                    assert generated and (x.logprobs[j], x.versions[j]) == (logprob, version)
                    masked.append(tuple(x.token_ids[: j + 1]))
                else:
                    assert (x.logprobs[j], x.versions[j]) == (0.0, -1)
            if role(tok, x.token_ids) == "checker":
                # Its loss tokens: its own reply, never the solver's answer shown in its prompt.
                call = next(c for c, p in zip(recorded, paths, strict=True) if p == leaf)
                assert tok.decode(call.prompt_ids).count("<|im_start|>") == 3
                first = x.loss_mask.index(1)
                assert first >= len(call.prompt_ids) and x.loss_mask[-1] == 1
        # Every generated token is a loss token of exactly one sample.
        generated = {prefix for prefix, (g, _, _) in labels.items() if g}
        assert len(masked) == len(set(masked)) and set(masked) == generated
    assert two_turns >= 1  # the random tiny model's checker almost never agrees
    assert len(samples) == len({x.sample_id for x in samples})
