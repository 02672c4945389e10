"""Rewards from the environment: a task's reward function, the agent's own reward (a Python
``AgentResult.reward`` or a command's ``SF_REWARD=`` line), the verifier; unusable rewards; the
reasoning-gym adapter. Pure functions first, then the agent runner on a real nats-server,
gateway and rollout worker (hf, tiny model).

The agents and reward functions below are loaded by the runner as ``tests.test_rewards:<name>``,
as a user's ``module:function`` would be.
"""

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from broker import codec
from broker.messages import ChatMessage, MessageRejected, RewardSpec, SessionEnded, TaskSubmitted
from common.exceptions import UnusableRewardError
from common.rewards import RewardsConfig, checked
from rollout.agents.agents import AgentContext, AgentResult, command_result, openai_messages
from rollout.agents.exceptions import InvalidTaskError, UnscoredError
from rollout.agents.reasoninggym import SCORE, reasoning_gym_tasks, score
from rollout.agents.rewards import CallLog, Transcript, scoring_for
from rollout.agents.verifiers import binary_reward
from seamlessflow.config import load_config
from seamlessflow.submit import parse_tasks, submit_tasks
from tests.support import eventually, stream_messages
from tests.test_agents import calls, closed_port_url, ended, runner, sample, unique

# -- agents and reward functions the runner loads by name -----------------------------------

TRANSCRIPTS: list[tuple[Transcript, TaskSubmitted]] = []
"""What ``calls_reward`` was given."""


async def own_reward_agent(ctx: AgentContext) -> AgentResult:
    """One gateway call; then the reward ``metadata["r<attempt>"]`` (absent: none)."""
    await ctx.client.chat.completions.create(
        model=ctx.model, messages=openai_messages(ctx.task.messages), max_tokens=2
    )
    attempt = ctx.session_id.rsplit("-", 1)[1]
    text = ctx.task.metadata.get(f"r{attempt}")
    return AgentResult(answer="done", reward=None if text is None else float(text))


async def two_calls_agent(ctx: AgentContext) -> AgentResult:
    """Two gateway calls, the second continuing the first; answers with the second reply."""
    messages = openai_messages(ctx.task.messages)
    reply = ""
    for _ in range(2):
        out = await ctx.client.chat.completions.create(
            model=ctx.model, messages=messages, max_tokens=3
        )
        reply = out.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    return AgentResult(answer=reply, turns=2, reward=-1.0)


async def oracle_agent(ctx: AgentContext) -> AgentResult:
    """Asks the gateway once, then answers with the task's reference in reasoning-gym's
    ``<answer>`` tags (so its attempts score 1.0)."""
    await ctx.client.chat.completions.create(
        model=ctx.model, messages=openai_messages(ctx.task.messages), max_tokens=2
    )
    return AgentResult(answer=f"thinking... <answer>{ctx.task.reward.reference}</answer>")


def calls_reward(transcript: Transcript, task: TaskSubmitted) -> float:
    """0.1 per gateway call seen."""
    TRANSCRIPTS.append((transcript, task))
    return 0.1 * len(transcript.calls)


def broken_reward(transcript: Transcript, task: TaskSubmitted) -> float:
    raise ZeroDivisionError("reward function bug on purpose")


async def async_reward(transcript: Transcript, task: TaskSubmitted) -> float:
    return 0.75


def nan_reward(transcript: Transcript, task: TaskSubmitted) -> float:
    return math.nan


NOT_CALLABLE = 3

# -- pure ------------------------------------------------------------------------------------


def task(
    task_id: str = "t",
    *,
    reference: str | None = "done",
    function: str | None = None,
    group_size: int = 1,
    **metadata: str,
) -> TaskSubmitted:
    return TaskSubmitted(
        task_id=task_id,
        messages=[ChatMessage(role="user", content="Say done.")],
        reward=RewardSpec(reference=reference, function=function),
        group_size=group_size,
        metadata=metadata,
    )


def scoring(spec: RewardSpec, *, agent_may_reward: bool = True):
    return scoring_for(
        spec,
        binary_reward,
        agent_may_reward=agent_may_reward,
        reward_range=(-1.0, 1.0),
        reward_modules=("rollout.agents", "tests.test_rewards"),
    )


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (math.nan, "not_finite"),
        (math.inf, "not_finite"),
        (-math.inf, "not_finite"),
        (1.5, "out_of_range"),
        (-1.01, "out_of_range"),
        ("1.0", "not_a_number"),
        (None, "not_a_number"),
        (True, "not_a_number"),
    ],
)
def test_unusable_rewards_are_refused_with_the_reason(value, kind):
    with pytest.raises(UnusableRewardError) as refused:
        checked(value, (-1.0, 1.0))
    assert refused.value.kind == kind


def test_usable_rewards_pass_as_floats():
    assert [checked(v, (-1.0, 1.0)) for v in (-1.0, 0, 1, 0.25)] == [-1.0, 0.0, 1.0, 0.25]
    assert type(checked(1, (-1.0, 1.0))) is float


def test_a_command_gives_its_reward_on_an_sf_reward_line():
    result = command_result("thinking\nSF_REWARD=0.5\nSF_REWARD= 0.25 \n42\n")
    assert (result.answer, result.reward) == ("42", 0.25)  # the last reward line wins
    assert command_result("SF_REWARD=1\n") == AgentResult(answer="", reward=1.0)
    assert command_result("a\r\nb\r\n").answer == "b" and command_result("a\nb").reward is None
    assert math.isnan(command_result("SF_REWARD=nan\nx").reward)  # refused when scored
    with pytest.raises(UnscoredError, match="printed 'SF_REWARD=lots'"):
        command_result("SF_REWARD=lots\nx")


async def test_the_reward_function_comes_first_then_the_agent_then_the_verifier():
    transcript = Transcript("s", "done", 1, agent_reward=-0.5)
    plain = Transcript("s", "done", 1)
    by_function = scoring(RewardSpec(function="tests.test_rewards:async_reward"))
    assert await by_function.score(task(), transcript) == (0.75, {})
    by_agent = scoring(RewardSpec(reference="done"))
    assert await by_agent.score(task(), transcript) == (-0.5, {})
    assert await by_agent.score(task(), plain) == (1.0, {"correct": 1.0})
    no_reference = scoring(RewardSpec())  # an agent that may reward: accepted
    with pytest.raises(UnscoredError, match="gave no reward and the task has no reference"):
        await no_reference.score(task(reference=None), plain)
    with pytest.raises(InvalidTaskError, match=r"no reward\.reference to verify against"):
        no_reference.verifier("t")("done")


async def test_a_reward_function_that_raises_or_returns_nan_leaves_the_attempt_unscored():
    transcript = Transcript("s", "done", 1)
    broken = scoring(RewardSpec(function="tests.test_rewards:broken_reward"))
    with pytest.raises(UnscoredError, match="raised ZeroDivisionError: reward function bug"):
        await broken.score(task(), transcript)
    assert broken.scorer(transcript) == "function:tests.test_rewards:broken_reward"
    nan = scoring(RewardSpec(function="tests.test_rewards:nan_reward"))
    with pytest.raises(UnscoredError, match="returned nan"):
        await nan.score(task(), transcript)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (RewardSpec(function="os:system"), "'os:system' is not under agents.reward_modules"),
        (RewardSpec(function="tests.test_rewards:missing"), "cannot be loaded: AttributeError"),
        (RewardSpec(function="rollout.agents.nope:f"), "cannot be loaded: ModuleNotFoundError"),
        (RewardSpec(function="tests.test_rewards:NOT_CALLABLE"), "is not callable"),
        (RewardSpec(function=SCORE, verifier="number", reference="x"), "needs a number"),
    ],
)
def test_reward_functions_that_cannot_be_used_are_refused(spec, says):
    with pytest.raises(InvalidTaskError, match=says):
        scoring(spec)


def test_a_built_in_agent_gives_no_reward_so_a_task_needs_a_reference_or_a_function():
    with pytest.raises(InvalidTaskError, match="needs a reference"):
        scoring(RewardSpec(), agent_may_reward=False)
    assert scoring(RewardSpec(function=SCORE), agent_may_reward=False).verify is None


def test_the_reward_range_is_one_typed_field():
    assert RewardsConfig().range == (-1.0, 1.0)
    assert RewardsConfig(range=[0, 10]).range == (0.0, 10.0)
    for bad in ([1.0, -1.0], [0.5, 1.0], [-math.inf, 1.0]):
        with pytest.raises(ValidationError, match=r"rewards\.range"):
            RewardsConfig(range=bad)


def test_the_wire_refuses_reward_functions_that_are_not_module_function():
    with pytest.raises(ValidationError, match="function"):
        RewardSpec(function="not a reference")
    assert RewardSpec(function="pkg.mod:f").function == "pkg.mod:f"


def test_the_transcript_is_the_whole_conversation():
    prompt = ({"role": "user", "content": "q"},)
    unseen = Transcript("s", "a", 1, prompt=prompt)  # a command's calls are not seen
    assert unseen.messages == [*prompt, {"role": "assistant", "content": "a"}]
    seen = Transcript(
        "s", "b", 2, calls=({"messages": [*prompt, {"role": "user", "content": "x"}]},)
    )
    assert seen.messages == [
        *prompt,
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "b"},
    ]


async def test_the_call_log_records_only_open_sessions():
    import httpx

    log = CallLog()
    log.open("a")
    url = "http://gw/v1/chat/completions"
    for sid in ("a", "b"):
        await log.on_request(
            httpx.Request(
                "POST",
                url,
                json={"messages": [{"role": "user", "content": sid}]},
                headers={"X-Session-Id": sid},
            )
        )
    await log.on_request(httpx.Request("GET", "http://gw/v1/models", headers={"X-Session-Id": "a"}))
    assert log.close("a") == ({"messages": [{"role": "user", "content": "a"}]},)
    assert log.close("b") == () and log.close("a") == ()


def test_reasoning_gym_tasks_are_made_in_code_and_scored_by_their_dataset():
    tasks = reasoning_gym_tasks("basic_arithmetic", size=4, seed=7, group_size=2, prefix="rg")
    again = reasoning_gym_tasks("basic_arithmetic", size=4, seed=7, group_size=2, prefix="rg")
    assert tasks == again and [t.task_id for t in tasks] == [f"rg-{i}" for i in range(4)]
    for t in tasks:
        assert t.reward.function == SCORE and t.group_size == 2 and t.env == "chat"
        assert [m.role for m in t.messages] == ["system", "user"]
        right = f"So: <answer>{t.reward.reference}</answer>"
        assert score(Transcript("s", right, 1), t) == 1.0
        assert score(Transcript("s", f"{t.reward.reference}\n", 1), t) == 1.0  # no tags
        assert score(Transcript("s", "<answer>no idea</answer>", 1), t) == 0.0
    legs = reasoning_gym_tasks("leg_counting", size=1, seed=1, min_animals=2, max_animals=2)
    assert legs[0].metadata["rg_config"] == '{"max_animals": 2, "min_animals": 2}'
    assert score(Transcript("s", legs[0].reward.reference, 1), legs[0]) == 1.0


def test_the_example_writes_tasks_that_submit_parses_and_its_config_loads():
    root = Path(__file__).parents[1]
    example = root / "examples" / "reasoning_gym"
    done = subprocess.run(
        [
            sys.executable,
            example / "make_tasks.py",
            "chain_sum",
            "--size",
            "3",
            "--group-size",
            "4",
            "--config",
            '{"max_terms": 2}',
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    tasks, errors = parse_tasks(done.stdout.splitlines(), "make_tasks")
    assert errors == [] and [t.task_id for t in tasks] == ["rg-0-0", "rg-0-1", "rg-0-2"]
    assert tasks == reasoning_gym_tasks("chain_sum", size=3, seed=0, group_size=4, max_terms=2)
    config = load_config(example / "run.toml")
    assert config.rewards.range == (0.0, 1.0) and config.tasks.env == "none"


# -- on a real broker, gateway and worker ----------------------------------------------------


@pytest.mark.newest_nats
async def test_reasoning_gym_tasks_through_the_agent_runner(stack, js, tok):
    """A real reasoning-gym generator, the built-in chat agent and the tiny model; then an agent
    that answers right: each attempt's reward is the dataset's own score of its answer."""
    names = stack.names
    prefix = unique("rg")
    tasks = reasoning_gym_tasks("chain_sum", size=2, seed=3, group_size=2, prefix=prefix)
    rewarded_before = sample("sf_agents_attempts_total", outcome="rewarded")
    async with runner(js, names, stack.url, max_tokens=8):
        await submit_tasks(js, names, tasks, progress=False)
        sessions = await ended(js, names, {t.task_id for t in tasks}, 4)
    by_id = {t.task_id: t for t in tasks}
    for s in sessions:
        (call,) = await calls(js, names, s.session_id)
        said = tok.decode(call.output_ids, skip_special_tokens=True)
        assert s.reward == score(Transcript(s.session_id, said, 1), by_id[s.task_id])
        assert "correct" not in s.metrics and "unscored" not in s.metrics
    assert sample("sf_agents_attempts_total", outcome="rewarded") == rewarded_before + 4

    right = reasoning_gym_tasks("chain_sum", size=2, seed=4, group_size=2, prefix=unique("rgo"))
    async with runner(js, names, stack.url, agent="tests.test_rewards:oracle_agent"):
        await submit_tasks(js, names, right, progress=False)
        sessions = await ended(js, names, {t.task_id for t in right}, 4)
    assert [s.reward for s in sessions] == [1.0] * 4


@pytest.mark.newest_nats
async def test_bad_rewards_leave_their_attempts_unscored_and_the_group_whole(stack, js, caplog):
    names = stack.names
    own = task(unique("own"), reference=None, group_size=4, r0="0.5", r1="nan", r2="7")
    broken = task(unique("broken"), function="tests.test_rewards:broken_reward", group_size=2)
    before = sample("sf_agents_attempts_total", outcome="unscored")
    function = "function:tests.test_rewards:broken_reward"
    raised_before = sample("sf_agents_unscored_total", scorer=function, reason="raised")
    caplog.set_level(logging.WARNING, logger="rollout.agents.runner")
    async with runner(
        js,
        names,
        stack.url,
        agent="tests.test_rewards:own_reward_agent",
        reward_modules=["rollout.agents", "tests.test_rewards"],
    ):
        await submit_tasks(js, names, [own, broken], progress=False)
        sessions = await ended(js, names, {own.task_id, broken.task_id}, 6)
    by_id = {s.session_id: s for s in sessions}
    assert by_id[f"{own.task_id}-0"].reward == 0.5
    assert "unscored" not in by_id[f"{own.task_id}-0"].metrics
    for i in (1, 2, 3):  # nan, out of range, no reward and no reference
        s = by_id[f"{own.task_id}-{i}"]
        assert (s.reward, s.metrics["unscored"], s.group_size) == (0.0, 1.0, 4)
    for i in (0, 1):
        assert by_id[f"{broken.task_id}-{i}"].metrics["unscored"] == 1.0
    assert sample("sf_agents_attempts_total", outcome="unscored") == before + 5
    assert sample("sf_agents_unscored_total", scorer=function, reason="raised") == raised_before + 2
    for scorer, reason in (("agent", "not_finite"), ("agent", "out_of_range")):
        assert sample("sf_agents_unscored_total", scorer=scorer, reason=reason) >= 1
    assert sample("sf_agents_unscored_total", scorer="verifier", reason="no_reward") >= 1
    logged = [r.getMessage() for r in caplog.records if "attempt_unscored" in r.getMessage()]
    assert any(
        f"task={broken.task_id}" in line and function in line and "ZeroDivisionError" in line
        for line in logged
    )
    assert any(f"task={own.task_id}" in line and "outside [-1, 1]" in line for line in logged)
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0  # all acked


@pytest.mark.newest_nats
async def test_a_reward_function_gets_the_calls_the_agent_made(stack, js):
    names = stack.names
    t = task(unique("calls"), function="tests.test_rewards:calls_reward", group_size=2)
    TRANSCRIPTS.clear()
    async with runner(
        js,
        names,
        stack.url,
        agent="tests.test_rewards:two_calls_agent",
        reward_modules=["tests.test_rewards"],
    ):
        await submit_tasks(js, names, [t], progress=False)
        sessions = await ended(js, names, {t.task_id}, 2)
    assert [s.reward for s in sessions] == [pytest.approx(0.2)] * 2  # the function, not -1.0
    assert len(TRANSCRIPTS) == 2
    for transcript, given in TRANSCRIPTS:
        # the task as admitted: the client's, with the scheduler's stamp
        assert given.admitted is not None and given.model_copy(update={"admitted": None}) == t
        assert transcript.agent_reward == -1.0 and transcript.turns == 2
        first, second = transcript.calls
        assert first["messages"] == [{"role": "user", "content": "Say done."}]
        assert second["messages"][:1] == first["messages"] and len(second["messages"]) == 3
        assert transcript.messages[-1] == {"role": "assistant", "content": transcript.answer}
        assert transcript.messages[:3] == second["messages"]
        assert transcript.prompt == (first["messages"][0],) and transcript.metrics == {}


@pytest.mark.newest_nats
async def test_tasks_whose_reward_function_cannot_be_used_are_dead_lettered(js, names):
    tasks = [task("not-allowed", function="os:system"), task("no-such", function="nope.x:f")]
    async with runner(js, names, closed_port_url(), reward_modules=["nope"]):
        await submit_tasks(js, names, tasks, progress=False)

        async def all_dead() -> bool:
            return len(await stream_messages(js, names.dead_stream, MessageRejected)) == 2

        await eventually(all_dead)
    dead = await stream_messages(js, names.dead_stream, MessageRejected)
    reasons = {codec.decode(TaskSubmitted, d.payload).task_id: d.reason for d in dead}
    assert "'os:system' is not under agents.reward_modules (nope)" in reasons["not-allowed"]
    assert "'nope.x:f' cannot be loaded: ModuleNotFoundError" in reasons["no-such"]
    assert await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end) == []


COMMAND = """
import sys
reward = sys.argv[1]
print("the model is not asked")
print(f"SF_REWARD={reward}")
print("done")
"""


@pytest.mark.newest_nats
@pytest.mark.parametrize(("printed", "reward"), [("0.25", 0.25), ("x", None)])
async def test_a_command_agent_prints_its_reward(stack, js, tmp_path: Path, printed, reward):
    names = stack.names
    script = tmp_path / "agent.py"
    script.write_text(COMMAND)
    t = task(unique("cmdr"), reference=None)
    async with runner(js, names, stack.url, command=[sys.executable, str(script), printed]):
        await submit_tasks(js, names, [t], progress=False)
        (s,) = await ended(js, names, {t.task_id}, 1)
    if reward is None:  # not a number: unscored
        assert s.reward == 0.0 and s.metrics["unscored"] == 1.0
    else:
        assert s.reward == reward and "unscored" not in s.metrics
