"""The agent runner on a real nats-server, a real gateway and a real rollout worker (hf, tiny
model); verifiers, session ids and the arithmetic task generator as pure functions.

The Python agents below (``flaky_agent``, ``sleepy_agent``) are loaded by the runner as
``tests.test_agents:<name>``, as a user's ``module:function`` would be.
"""

import asyncio
import logging
import math
import random
import re
import shutil
import signal
import socket
import sys
import time
import uuid
from contextlib import ExitStack, asynccontextmanager, suppress
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from broker import codec
from broker.messages import (
    CallRecorded,
    ChatMessage,
    MessageRejected,
    RewardSpec,
    SessionEnded,
    TaskSubmitted,
)
from broker.metrics import REGISTRY as INGRESS_METRICS
from broker.subjects import NAME_PATTERN, Durable, RunNames
from rollout.agents import runner as runner_module
from rollout.agents.agents import AgentContext, AgentResult, load_agent
from rollout.agents.arithmetic import (
    FEEDBACK,
    arithmetic_reward,
    arithmetic_task,
    arithmetic_tasks,
)
from rollout.agents.clients import HEALTHY_FOR_S, TASKS_PER_POOL, GatewayClients
from rollout.agents.config import AgentsConfig
from rollout.agents.exceptions import AgentLoadError, GatewayUnavailableError, InvalidTaskError
from rollout.agents.outage import REGISTRY as OUTAGE_METRICS
from rollout.agents.runner import AgentRunner
from rollout.agents.sessions import gateway_headers, group_id, session_id
from rollout.agents.verifiers import bind, exact_match, last_number, number
from rollout.gateway.calls import REGISTRY as GATEWAY_METRICS
from seamlessflow.config import load_config
from seamlessflow.processes import ServiceProcess
from seamlessflow.submit import submit_tasks
from tests.support import (
    SMALL_RUN,
    GatewayThread,
    admitting,
    eventually,
    gateway_config,
    metric,
    stream_messages,
)

# -- agents the runner loads by name ---------------------------------------------------------

STARTED: list[str] = []
"""Sessions ``sleepy_agent`` was started on."""


async def flaky_agent(ctx: AgentContext) -> AgentResult:
    """Attempt 0 raises; the others hang (until the attempt times out)."""
    if ctx.session_id.endswith("-0"):
        raise RuntimeError("agent crashed on purpose")
    await asyncio.sleep(3600)
    raise AssertionError("not reached")


async def judged_agent(ctx: AgentContext) -> AgentResult:
    """Asks a judge at another address (``metadata["judge"]``) with a client of its own."""
    judge = openai.AsyncOpenAI(base_url=ctx.task.metadata["judge"], api_key="x", max_retries=0)
    async with judge:
        await judge.models.list()
    return AgentResult(answer="done")


GATEWAY_GONE: set[str] = set()
"""Tasks whose gateway a test has stopped."""


async def raw_http_agent(ctx: AgentContext) -> AgentResult:
    """Asks the gateway for its models with plain httpx, not the OpenAI SDK; on the task's first
    run only once its task is in ``GATEWAY_GONE``, and with ``metadata["hang"]`` it then hangs
    instead (a client with no timeout)."""
    STARTED.append(ctx.session_id)
    if not re.search(r"-r\d+$", ctx.session_id):
        while ctx.task.task_id not in GATEWAY_GONE:
            await asyncio.sleep(0.05)
        if ctx.task.metadata.get("hang"):
            await asyncio.sleep(3600)
    async with httpx.AsyncClient() as client:
        auth = {"Authorization": f"Bearer {ctx.api_key}"}
        (await client.get(f"{ctx.gateway_url}/models", headers=auth)).raise_for_status()
    return AgentResult(answer="done")


async def raw_chat_agent(ctx: AgentContext) -> AgentResult:
    """One chat call with plain httpx, not the OpenAI SDK: an error status is httpx's error."""
    STARTED.append(ctx.session_id)
    auth = {"Authorization": f"Bearer {ctx.api_key}"}
    body = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(
            f"{ctx.gateway_url}/chat/completions",
            json=body,
            headers={**auth, **gateway_headers(ctx.session_id, ctx.task.task_id)},
        )
    reply.raise_for_status()
    return AgentResult(answer=reply.json()["choices"][0]["message"]["content"])


async def sleepy_agent(ctx: AgentContext) -> AgentResult:
    """Answers "done" after ``metadata["sleep"]`` seconds, on the task's first delivery only."""
    STARTED.append(ctx.session_id)
    if not re.search(r"-d\d+$", ctx.session_id):  # not a redelivery (the task id may hold "-d")
        await asyncio.sleep(float(ctx.task.metadata["sleep"]))
    return AgentResult(answer="done")


# -- helpers ---------------------------------------------------------------------------------


def chat_task(
    task_id: str,
    *,
    verifier: str = "exact_match",
    reference: str | None = "done",
    group_size: int = 1,
    env: str = "chat",
    **metadata: str,
) -> TaskSubmitted:
    return TaskSubmitted(
        task_id=task_id,
        messages=[ChatMessage(role="user", content="Say done.")],
        env=env,
        reward=RewardSpec(verifier=verifier, reference=reference),
        group_size=group_size,
        metadata=metadata,
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def sample(name: str, **labels: str) -> float:
    """A sample of the runner's registries or the ingress's (the runner under test runs here)."""
    registries = (runner_module.REGISTRY, OUTAGE_METRICS, INGRESS_METRICS)
    return sum(r.get_sample_value(name, labels) or 0.0 for r in registries)


@asynccontextmanager
async def runner(js, names: RunNames, gateway_url: str, **fields):
    """An ``AgentRunner`` on this event loop, behind the scheduler's admission; stopped (and
    awaited) on leaving."""
    stop = asyncio.Event()
    nc = js._nc  # nats-py: the connection of the JetStream context the tests are given
    agents = AgentRunner(nc, names, SMALL_RUN.tasks, AgentsConfig(**fields), gateway_url)
    async with admitting(js, names):
        running = asyncio.create_task(agents.run(stop))
        try:
            yield stop, running
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)


async def ended(js, names: RunNames, task_ids: set[str], count: int) -> list[SessionEnded]:
    """The ``SessionEnded`` of these tasks, once there are ``count`` (and no more)."""
    found: list[SessionEnded] = []

    async def enough() -> bool:
        nonlocal found
        stored = await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end)
        found = [m for m in stored if m.task_id in task_ids]
        return len(found) >= count

    await eventually(enough, timeout=60)
    assert len(found) == count
    return found


async def calls(js, names: RunNames, sid: str) -> list[CallRecorded]:
    return await stream_messages(js, names.traj_stream, CallRecorded, names.traj_calls(sid))


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# -- pure ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reference", "exact", "numeric"),
    [
        ("12", "12", True, True),
        ("  12\n", "12", True, True),
        ("12 apples", "12", False, True),
        ("x=12.0!", "12", False, True),
        ("-3", "-3", True, True),
        ("3-4", "-4", False, False),  # the first number is 3
        ("1 2", "2", False, False),
        ("twelve", "12", False, False),
        ("", "0", False, False),
    ],
)
def test_verifiers(answer, reference, exact, numeric):
    assert exact_match(answer, reference) is exact
    assert number(answer, reference) is numeric


@settings(max_examples=60, deadline=None)
@given(st.integers(-(10**9), 10**9), st.text(alphabet="abc =?!.\n", max_size=8))
def test_number_compares_the_first_number(value, noise):
    assert number(f"{noise} {value} 7", str(value))
    assert number(f"{noise} {value}.0", f" {value} ")
    assert not number(f"{noise} {value + 1} {value}", str(value))
    assert bind(RewardSpec(verifier="number", reference=str(value)))(f"= {value}.")


@settings(max_examples=60, deadline=None)
@given(st.integers(-(10**9), 10**9), st.text(alphabet="abc =?!.\n", max_size=8))
def test_last_number_compares_the_result_of_a_worked_answer(value, noise):
    assert last_number(f"{noise} 3+4={value}", str(value))
    assert last_number(f"The answer is {value}.{noise}", f" {value} ")
    assert not last_number(f"{value} then {value + 1}", str(value))
    assert bind(RewardSpec(verifier="last_number", reference=str(value)))(f"2+2={value}")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (RewardSpec(verifier="regex", reference="x"), "unknown verifier 'regex'"),
        (RewardSpec(verifier="exact_match"), "needs a reference"),
        (RewardSpec(verifier="number", reference="five"), "needs a number"),
    ],
)
def test_unusable_reward_specs_are_refused(spec, says):
    with pytest.raises(InvalidTaskError, match=says):
        bind(spec)


ids = st.from_regex(NAME_PATTERN, fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(
    ids,
    ids,
    st.integers(0, 1023),
    st.integers(0, 1023),
    st.integers(1, 10_000),
    st.integers(0, 10_000),
)
def test_session_ids_are_ids_and_never_shared(task_id, other_task, attempt, other, delivery, retry):
    sid = session_id(task_id, attempt, delivery, retry)
    assert re.fullmatch(NAME_PATTERN, sid)
    assert sid == session_id(task_id, attempt, delivery, retry)  # deterministic
    assert sid != session_id(task_id, attempt, delivery + 1, retry)  # a redelivery starts afresh
    assert sid != session_id(task_id, attempt, delivery, retry + 1)  # so does a held retry
    assert sid != session_id(task_id, attempt, delivery + 1, 0)
    if (task_id, attempt) != (other_task, other):
        assert sid != session_id(other_task, other, delivery, retry)
    if len(task_id) <= 60 and delivery == 1 and retry == 0 and attempt < 100:
        assert sid == f"{task_id}-{attempt}"
    group = group_id(task_id, delivery, retry)
    assert re.fullmatch(NAME_PATTERN, group)
    assert (group == task_id) == (delivery == 1 and retry == 0)  # a retried task: a new group
    assert group != group_id(task_id, delivery + 1, retry)
    assert group != group_id(task_id, delivery, retry + 1)


def test_arithmetic_tasks():
    tasks = arithmetic_tasks(
        random.Random(7), 50, max_operand=20, group_size=3, max_turns=2, prefix="q"
    )
    again = arithmetic_tasks(
        random.Random(7), 50, max_operand=20, group_size=3, max_turns=2, prefix="q"
    )
    assert tasks == again
    assert [t.task_id for t in tasks] == [f"q-{i}" for i in range(50)]
    for task in tasks:
        (message,) = task.messages
        a, b = (int(x) for x in message.content.removesuffix("=").split("+"))
        assert message.role == "user" and message.content == f"{a}+{b}="
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert task.reward.reference == str(a + b) and task.env == "arithmetic"
        assert (task.group_size, task.max_turns) == (3, 2)
    assert len({t.messages[0].content for t in tasks}) > 10
    single = arithmetic_task("t", 4, 5, group_size=1, max_turns=3)
    assert single.messages[0].content == "4+5=" and single.reward.reference == "9"
    assert bind(single.reward)("9") and not bind(single.reward)("10")
    assert FEEDBACK == "wrong"
    assert [arithmetic_reward(c, t) for c, t in [(True, 1), (True, 2), (True, 5), (False, 1)]] == [
        1.0,
        0.5,
        0.5,
        0.0,
    ]


def test_config(tmp_path: Path):
    with pytest.raises(ValidationError, match="at most one"):
        AgentsConfig(agent="a:b", command=["x"])
    with pytest.raises(ValidationError, match="agent"):
        AgentsConfig(agent="not a reference")
    toml = tmp_path / "run.toml"
    toml.write_text('[agents]\ncommand = ["node", "agent.mjs"]\nmax_tasks = 2\n')
    config = load_config(toml).agents
    assert config.command == ["node", "agent.mjs"] and config.max_tasks == 2
    assert config.temperature == 1.0  # the rest keeps its defaults
    with pytest.raises(AgentLoadError, match="cannot be loaded"):
        load_agent("tests.test_agents:no_such_agent")
    with pytest.raises(AgentLoadError, match="async def"):
        load_agent("json:dumps")


# -- on a real broker, gateway and worker ----------------------------------------------------


@pytest.mark.newest_nats
async def test_arithmetic_groups_end_with_verified_rewards(stack, js, tok):
    names = stack.names
    prefix = unique("ar")
    tasks = arithmetic_tasks(
        random.Random(1), 2, max_operand=9, group_size=3, max_turns=2, prefix=prefix
    )
    before = {o: sample("sf_agents_attempts_total", outcome=o) for o in ("correct", "wrong")}
    done_before = sample("sf_agents_tasks_total", outcome="done")
    turns_before = sample("sf_agents_turns_count")
    async with runner(js, names, stack.url):
        await submit_tasks(js, names, tasks, progress=False)
        sessions = await ended(js, names, {t.task_id for t in tasks}, 6)
        await eventually(lambda: sample("sf_agents_tasks_total", outcome="done") == done_before + 2)
    by_task = {t.task_id: t for t in tasks}
    assert sorted(s.session_id for s in sessions) == sorted(
        f"{t.task_id}-{i}" for t in tasks for i in range(3)
    )
    # Each task's sessions carry its admission ticket, one per task
    stamps = {(s.task_id, s.admitted.ticket if s.admitted else None) for s in sessions}
    assert len(stamps) == 2 and None not in {t for _, t in stamps}, stamps
    assert len({t for _, t in stamps}) == 2
    multi_turn = 0
    for s in sessions:
        task = by_task[s.task_id]
        assert (s.group_id, s.group_size) == (task.task_id, 3)
        recorded = await calls(js, names, s.session_id)
        answers = [tok.decode(c.output_ids, skip_special_tokens=True) for c in recorded]
        right = [number(a, task.reward.reference) for a in answers]
        # the agent stops at the first right answer, or after max_turns
        assert 1 <= len(recorded) <= 2 and not any(right[:-1])
        assert len(recorded) == 2 or right[0]
        assert s.reward == arithmetic_reward(right[-1], len(recorded))
        assert s.reward in {0.0, 0.5, 1.0}
        assert s.metrics["turns"] == len(recorded) and s.metrics["correct"] == right[-1]
        assert "failed" not in s.metrics
        if len(recorded) == 2:
            multi_turn += 1
            first, second = recorded
            assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
            fed_back = tok.decode(second.prompt_ids[len(first.prompt_ids) :])
            assert FEEDBACK in fed_back and task.messages[0].content in tok.decode(first.prompt_ids)
            if "\ufffd" not in answers[0]:  # a clean echo reuses the generated ids
                turn = first.prompt_ids + first.output_ids
                assert second.prompt_ids[: len(turn)] == turn
    assert multi_turn >= 1  # the random tiny model is almost always wrong first
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0  # acked
    after = {o: sample("sf_agents_attempts_total", outcome=o) for o in ("correct", "wrong")}
    assert sum(after.values()) - sum(before.values()) == 6
    assert sample("sf_agents_turns_count") - turns_before == 6


@pytest.mark.newest_nats
async def test_the_runner_makes_as_many_calls_at_once_as_it_runs_attempts(stack, js):
    """13 tasks of 8 attempts at once, each one long call: the gateway has more than 100 of them
    open at once (httpx's default pool, which the runner used to have, held calls past the
    100th back in the runner until one ended: that wait was counted as the agent's own time)."""
    names = stack.names
    prefix = unique("pool")
    tasks = [chat_task(f"{prefix}-{i}", group_size=8, max_tokens="400") for i in range(13)]
    most = 0.0
    async with runner(js, names, stack.url, max_tasks=13, shutdown_grace_s=0.0):
        await submit_tasks(js, names, tasks, progress=False)
        with suppress(TimeoutError):
            async with asyncio.timeout(30):
                while most <= 100:
                    most = max(most, GATEWAY_METRICS.get_sample_value("sf_gateway_calls_open"))
                    await asyncio.sleep(0.01)
    # The runner stopped mid-call: the gateway ends every call, and the tasks it handed back
    # go, so that the module's other tests find the stack as it was.
    await eventually(lambda: GATEWAY_METRICS.get_sample_value("sf_gateway_calls_open") == 0)
    await js.purge_stream(names.tasks_stream)
    assert most > 100, most


async def test_a_tasks_attempts_share_one_of_a_few_connection_pools():
    """httpcore's pool costs O(connections x idle ones) per request: the runner spreads its
    tasks over ceil(max_tasks / TASKS_PER_POOL) pools, a task's attempts all in one."""

    async def ignore(request) -> None:
        return None

    clients = GatewayClients(
        "http://127.0.0.1:1/v1", "unused", max_tasks=13, timeout_s=1.0, on_request=ignore
    )
    try:
        chosen = [clients.for_task(f"task-{i}") for i in range(200)]
        assert len({id(c) for c in chosen}) == math.ceil(13 / TASKS_PER_POOL) == 4
        assert all(clients.for_task(f"task-{i}") is chosen[i] for i in range(200))
    finally:
        await clients.aclose()


@pytest.mark.newest_nats
async def test_tasks_starting_together_ask_the_gateway_once_whether_it_serves(stack):
    """The tasks a step's end admits at once share one ``/health`` answer for ``HEALTHY_FOR_S``
    (they made one call each, a round trip before each task's first call); a call that found
    the gateway down makes the next ask again; a gateway that is not there fails every caller."""
    asked: list[str] = []

    async def count(request) -> None:
        asked.append(request.url.path)

    clients = GatewayClients(stack.url, "unused", max_tasks=8, timeout_s=5.0, on_request=count)
    gone = GatewayClients(closed_port_url(), "unused", max_tasks=8, timeout_s=5.0, on_request=count)
    try:
        models = await asyncio.gather(*(clients.serving() for _ in range(8)))
        assert set(models) == {"tiny"} and asked == ["/health", "/v1/models"]
        await clients.serving()
        assert asked.count("/health") == 1
        clients.down()
        await clients.serving()
        assert asked.count("/health") == 2
        await asyncio.sleep(HEALTHY_FOR_S)
        await clients.serving()
        assert asked.count("/health") == 3 and asked.count("/v1/models") == 1
        failed = await asyncio.gather(*(gone.serving() for _ in range(3)), return_exceptions=True)
        assert all(isinstance(f, GatewayUnavailableError) for f in failed), failed
        assert asked.count("/health") == 4  # one for the three
    finally:
        await clients.aclose()
        await gone.aclose()


@pytest.mark.newest_nats
async def test_failed_attempts_still_end_their_sessions(stack, js):
    names = stack.names
    task = chat_task(unique("fl"), group_size=2)
    failed_before = sample("sf_agents_attempts_total", outcome="failed")
    timed_out_before = sample("sf_agents_attempts_total", outcome="timed_out")
    async with runner(
        js, names, stack.url, agent="tests.test_agents:flaky_agent", attempt_timeout_s=0.5
    ):
        await submit_tasks(js, names, [task], progress=False)
        sessions = await ended(js, names, {task.task_id}, 2)
        await eventually(
            lambda: sample("sf_agents_attempts_total", outcome="timed_out") == timed_out_before + 1
        )
    assert sorted(s.session_id for s in sessions) == [f"{task.task_id}-0", f"{task.task_id}-1"]
    for s in sessions:
        assert s.reward == 0.0 and s.metrics["failed"] == 1.0
        assert (s.group_id, s.group_size) == (task.task_id, 2)
    assert sample("sf_agents_attempts_total", outcome="failed") == failed_before + 1
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0


@pytest.mark.newest_nats
async def test_an_agents_own_service_down_fails_its_attempts_not_the_gateway(stack, js, caplog):
    """An agent's judge, at another address, refuses the connection: the same OpenAI error a
    gateway that is down gives, but the agent's failure: its attempts fail (their sessions end,
    scored 0) and the runner does not hold its tasks for a gateway that is serving."""
    names = stack.names
    judge = closed_port_url()
    task = chat_task(unique("judged"), group_size=2, judge=judge)
    failed0 = sample("sf_agents_attempts_total", outcome="failed")
    unavailable0 = sample("sf_agents_attempts_total", outcome="unavailable")
    caplog.set_level(logging.INFO)
    async with runner(js, names, stack.url, agent="tests.test_agents:judged_agent"):
        await submit_tasks(js, names, [task], progress=False)
        sessions = await ended(js, names, {task.task_id}, 2)
    assert all(s.reward == 0.0 and s.metrics["failed"] == 1.0 for s in sessions), sessions
    assert sample("sf_agents_attempts_total", outcome="failed") == failed0 + 2
    assert sample("sf_agents_attempts_total", outcome="unavailable") == unavailable0
    assert sample("sf_ingress_paused", source="tasks") == 0
    failed = [r.getMessage() for r in caplog.records if "attempt_failed" in r.getMessage()]
    assert len(failed) == 2 and all(f"APIConnectionError from {judge}" in m for m in failed)
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0


@pytest.mark.newest_nats
@pytest.mark.parametrize("hang", ["", "yes"], ids=["refused", "hangs"])
async def test_an_agent_failing_while_the_gateway_is_down_holds_its_task_whatever_its_client(
    stack, js, broker, tiny_model_dir, hang
):
    """An agent calling the gateway with plain httpx gets httpx's error, not the SDK's, when the
    gateway goes away mid-attempt, or (a client without a timeout) hangs until the attempt
    times out: the runner asks ``/health`` before scoring it, finds the gateway down, and
    holds the task (nothing scored 0.0) until it serves again."""
    names = stack.names
    url = closed_port_url()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    config = gateway_config(tiny_model_dir, names.run).model_copy(update={"port": port})
    task = chat_task(unique("raw"), group_size=2, hang=hang)
    failed0 = sample("sf_agents_attempts_total", outcome="failed")
    timed_out0 = sample("sf_agents_attempts_total", outcome="timed_out")
    unavailable0 = sample("sf_agents_attempts_total", outcome="unavailable")
    agent = "tests.test_agents:raw_http_agent"
    async with runner(js, names, url, agent=agent, attempt_timeout_s=2.0) as (_, running):
        with GatewayThread(config, broker.url):
            await submit_tasks(js, names, [task], progress=False)
            await eventually(lambda: f"{task.task_id}-1" in STARTED, watch=running)
        GATEWAY_GONE.add(task.task_id)  # the gateway is gone: the attempts' calls fail
        await eventually(lambda: sample("sf_ingress_paused", source="tasks") == 1, watch=running)
        assert sample("sf_agents_attempts_total", outcome="unavailable") > unavailable0
        with GatewayThread(config, broker.url):
            sessions = await ended(js, names, {task.task_id}, 2)
    assert sorted(s.session_id for s in sessions) == [f"{task.task_id}-{i}-r1" for i in range(2)]
    assert all(s.reward == 1.0 and "failed" not in s.metrics for s in sessions), sessions
    assert sample("sf_agents_attempts_total", outcome="failed") == failed0
    assert sample("sf_agents_attempts_total", outcome="timed_out") == timed_out0


@pytest.mark.newest_nats
async def test_tasks_that_cannot_be_run_are_dead_lettered(js, names):
    tasks = [
        chat_task("unknown-verifier", verifier="regex"),
        chat_task("no-agent", env="maze"),
        chat_task("bad-reference", verifier="number", reference="five"),
    ]
    rejected_before = sample("sf_agents_tasks_total", outcome="rejected")
    # The gateway is never asked: these are refused before any agent runs.
    async with runner(js, names, closed_port_url()):
        await submit_tasks(js, names, tasks, progress=False)

        async def all_dead() -> bool:
            return len(await stream_messages(js, names.dead_stream, MessageRejected)) == 3

        await eventually(all_dead)
    dead = await stream_messages(js, names.dead_stream, MessageRejected)
    reasons = {codec.decode(TaskSubmitted, d.payload).task_id: d.reason for d in dead}
    assert set(reasons) == {"unknown-verifier", "no-agent", "bad-reference"}
    known = "(known: exact_match, last_number, number)"
    assert f"unknown verifier 'regex' {known}" in reasons["unknown-verifier"]
    assert "no agent for env 'maze'" in reasons["no-agent"]
    assert "needs a number" in reasons["bad-reference"]
    assert all(d.source == "tasks" for d in dead)
    assert sample("sf_agents_tasks_total", outcome="rejected") == rejected_before + 3
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0
    assert await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end) == []


@pytest.mark.faults  # a 60 s outage: in the fault suite (make test-faults)
@pytest.mark.newest_nats
async def test_a_gateway_outage_holds_the_tasks_and_runs_every_one_when_it_returns(
    stack, js, broker, tiny_model_dir, caplog
):
    """The gateway goes away for 60 s with tasks queued: the runner takes no more tasks, runs
    none, fails and dead-letters none, logs one line for the pause and one for the resume (no
    traceback), and runs every task once a gateway serves again on the same port."""
    names = stack.names
    url = closed_port_url()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    config = gateway_config(tiny_model_dir, names.run).model_copy(update={"port": port})
    warm = chat_task(unique("warm"))
    tasks = [chat_task(unique("out"), group_size=2) for _ in range(4)]
    ids = {t.task_id for t in tasks}
    retried0 = sample("sf_agents_tasks_total", outcome="retried")
    caplog.set_level(logging.INFO)
    async with runner(js, names, url, max_tasks=2, max_tokens=4) as (_, running):
        with GatewayThread(config, broker.url):
            await submit_tasks(js, names, [warm], progress=False)
            await ended(js, names, {warm.task_id}, 1)
        # The gateway is gone: 2 tasks are taken (max_tasks) and held, the other 2 stay queued.
        down = time.monotonic()
        await submit_tasks(js, names, tasks, progress=False)
        await eventually(lambda: sample("sf_ingress_paused", source="tasks") == 1, watch=running)
        await asyncio.sleep(60 - (time.monotonic() - down))
        stored = await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end)
        assert not [m for m in stored if m.task_id in ids]
        info = await js.consumer_info(names.tasks_stream, Durable.AGENTS)
        assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (2, 2, 0)
        # Each held task is counted once, however often the ingress retried it.
        assert sample("sf_agents_tasks_total", outcome="retried") - retried0 == 2
        with GatewayThread(config, broker.url):
            sessions = await ended(js, names, ids, 2 * len(tasks))
            await eventually(lambda: sample("sf_ingress_paused", source="tasks") == 0)
    by_task: dict[str, list[SessionEnded]] = {}
    for s in sessions:
        by_task.setdefault(s.task_id, []).append(s)
    assert {t: len(ss) for t, ss in by_task.items()} == dict.fromkeys(ids, 2)
    held = {t for t, ss in by_task.items() if re.search(r"-r\d+$", ss[0].session_id)}
    assert len(held) == 2  # the two taken during the outage ran in new sessions
    for t, ss in by_task.items():
        suffix = re.search(r"-r\d+$", ss[0].session_id).group() if t in held else ""
        assert sorted(s.session_id for s in ss) == [f"{t}-{i}{suffix}" for i in range(2)]
        assert {s.group_id for s in ss} == {t + suffix} and "failed" not in ss[0].metrics
    assert await stream_messages(js, names.dead_stream, MessageRejected) == []
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "broker.ingress"]
    (paused,) = [line for line in lines if line.startswith("ingress_paused")]
    assert "source=tasks" in paused and "GatewayUnavailableError" in paused
    (resumed,) = [line for line in lines if line.startswith("ingress_resumed")]
    assert float(re.search(r"after_s=([\d.]+)", resumed).group(1)) >= 55
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.getMessage().startswith("task_retried")]


@pytest.mark.newest_nats
@pytest.mark.parametrize("client", ["sdk-unanswered", "own-client-503"])
async def test_a_frozen_rollout_holds_the_task_never_scores_it(
    stack, js, broker, tiny_model_dir, client
):
    """The rollout worker freezes (SIGSTOP): the calls wait in the gen queue. Through the SDK the
    agent's call gets no answer within ``request_timeout_s``; through its own plain httpx it gets
    the 503 of a gateway whose ``queue_timeout_s`` is 1 s, raised as httpx's error while
    ``/health`` answers (the gateway tells the runner: ``CallUnavailable``). Either way the
    rollout does not serve now; the agent did not fail: the task is held (nothing scored 0.0),
    and runs once the worker thaws."""
    names = stack.names
    task = chat_task(unique("frozen"), group_size=2)
    failed0 = sample("sf_agents_attempts_total", outcome="failed")
    unavailable0 = sample("sf_agents_attempts_total", outcome="unavailable")
    with ExitStack() as gateways:
        if client == "own-client-503":
            config = gateway_config(tiny_model_dir, names.run, queue_timeout_s=1.0)
            url = gateways.enter_context(GatewayThread(config, broker.url)).url
            fields = {"agent": "tests.test_agents:raw_chat_agent"}
        else:
            url, fields = stack.url, {"request_timeout_s": 3, "max_tokens": 4}
        stack.worker.proc.send_signal(signal.SIGSTOP)
        try:
            async with runner(js, names, url, **fields) as (_, running):
                await submit_tasks(js, names, [task], progress=False)
                paused = lambda: sample("sf_ingress_paused", source="tasks") == 1  # noqa: E731
                await eventually(paused, watch=running, timeout=30)
                assert sample("sf_agents_attempts_total", outcome="unavailable") > unavailable0
                stored = await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end)
                assert not [m for m in stored if m.task_id == task.task_id]
                stack.worker.proc.send_signal(signal.SIGCONT)
                sessions = await ended(js, names, {task.task_id}, 2)
        finally:
            stack.worker.proc.send_signal(signal.SIGCONT)
    assert all("failed" not in s.metrics for s in sessions), sessions
    assert all(re.search(r"-r\d+$", s.session_id) for s in sessions)  # run again, new sessions
    assert sample("sf_agents_attempts_total", outcome="failed") == failed0


@pytest.mark.newest_nats
async def test_a_notice_that_does_not_decode_is_counted_and_the_runner_goes_on(stack, js, caplog):
    """A ``CallUnavailable`` that is not one (here published by the test, as a gateway with a
    bug would): counted, logged with its subject, ignored; the runner runs tasks still."""
    names = stack.names
    bad0 = sample("sf_agents_bad_unavailable_notices_total")
    task = chat_task(unique("after-bad"))
    async with runner(js, names, stack.url, max_tokens=4) as (_, running):

        async def counted() -> bool:  # published until the runner's subscription has one
            await js._nc.publish(names.gw_unavailable("s-1"), b"\xc1 not msgpack")
            return sample("sf_agents_bad_unavailable_notices_total") > bad0

        await eventually(counted, watch=running)
        await submit_tasks(js, names, [task], progress=False)
        (session,) = await ended(js, names, {task.task_id}, 1)
    assert "failed" not in session.metrics
    assert any(
        r.getMessage().startswith("bad_unavailable_notice") and names.gw_unavailable("s-1") in
        r.getMessage() for r in caplog.records
    )  # fmt: skip


@pytest.mark.newest_nats
async def test_stop_lets_attempts_finish_within_the_grace_then_hands_tasks_back(stack, js):
    names = stack.names
    # Within the grace: the attempt finishes, its session ends, the task is acked.
    quick = chat_task(unique("gr"), sleep="1.0")
    async with runner(js, names, stack.url, agent="tests.test_agents:sleepy_agent") as (
        stop,
        running,
    ):
        await submit_tasks(js, names, [quick], progress=False)
        await eventually(lambda: f"{quick.task_id}-0" in STARTED)
        stop.set()
        await asyncio.wait_for(running, 30)
    (s,) = await ended(js, names, {quick.task_id}, 1)
    assert (s.session_id, s.reward) == (f"{quick.task_id}-0", 1.0)
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0

    # Past the grace: the attempt is cancelled, nothing is published, the task goes back...
    slow = chat_task(unique("hb"), sleep="3600")
    async with runner(
        js,
        names,
        stack.url,
        agent="tests.test_agents:sleepy_agent",
        shutdown_grace_s=0.2,
        retry_delay_s=0.1,
    ) as (stop, running):
        await submit_tasks(js, names, [slow], progress=False)
        await eventually(lambda: f"{slow.task_id}-0" in STARTED)
        stop.set()
        await asyncio.wait_for(running, 10)
    stored = await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end)
    assert not [m for m in stored if m.task_id == slow.task_id]
    assert (await js.stream_info(names.tasks_stream)).state.messages == 1
    # ...and the next runner runs it afresh, in new sessions.
    async with runner(js, names, stack.url, agent="tests.test_agents:sleepy_agent"):
        (s,) = await ended(js, names, {slow.task_id}, 1)
    assert re.fullmatch(rf"{slow.task_id}-0-d[2-9]", s.session_id) and s.reward == 1.0


@pytest.mark.newest_nats
async def test_a_task_delivered_again_runs_one_group(stack, js):
    """A task admitted again (as an outage can make happen: its in-progress signals or its ack
    lost) while it runs, and once more after it is done: one group runs, each copy is acked."""
    names = stack.names
    task = chat_task(unique("dup"), group_size=2, sleep="1.0")
    before = sample("sf_agents_tasks_total", outcome="duplicate")

    async def admit(copy: int) -> None:  # another admitted copy: a message of its own
        headers = codec.headers(msg_id=f"copy{copy}-{task.task_id}")
        await js.publish(names.tasks_admitted, codec.encode(task), headers=headers)

    async with runner(js, names, stack.url, agent="tests.test_agents:sleepy_agent", max_tasks=4):
        await admit(0)
        await eventually(lambda: f"{task.task_id}-0" in STARTED)
        await admit(1)  # while it runs
        await eventually(lambda: sample("sf_agents_tasks_total", outcome="duplicate") == before + 1)
        await ended(js, names, {task.task_id}, 2)
        await admit(2)  # after it is done
        await eventually(lambda: sample("sf_agents_tasks_total", outcome="duplicate") == before + 2)
        await eventually(lambda: _stored(js, names.tasks_stream, 0), timeout=10)
    stored = await stream_messages(js, names.traj_stream, SessionEnded, names.traj_end)
    sessions = sorted(m.session_id for m in stored if m.task_id == task.task_id)
    assert sessions == [f"{task.task_id}-0", f"{task.task_id}-1"]  # one group, not three


async def _stored(js, stream: str, count: int) -> bool:
    return (await js.stream_info(stream)).state.messages == count


AGENT_SCRIPT = """
import json, os, sys, urllib.request

task = json.load(sys.stdin)
if task["metadata"].get("mode") == "fail":
    print("refusing on purpose", file=sys.stderr)
    sys.exit(3)
body = {"model": os.environ["SF_MODEL"], "messages": task["messages"], "max_tokens": 4}
request = urllib.request.Request(
    os.environ["SF_GATEWAY_URL"] + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json", "X-Session-Id": os.environ["SF_SESSION_ID"]},
)
reply = json.load(urllib.request.urlopen(request, timeout=60))
print("the model said", json.dumps(reply["choices"][0]["message"]["content"]))
print(int(task["metadata"]["a"]) + int(task["metadata"]["b"]))  # the answer: the last line
"""


@pytest.mark.newest_nats
async def test_command_agent_through_the_cli(stack, js, broker, tmp_path: Path):
    names = stack.names
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    sums = arithmetic_task(unique("cmd"), 3, 4, group_size=2, max_turns=2)
    fails = chat_task(unique("cmdfail"), mode="fail")
    agents = ServiceProcess(
        "agents",
        "agents",
        "--nats",
        broker.url,
        "--run",
        names.run,
        "--gateway",
        stack.url.removesuffix("/v1"),
        "--command",
        f"{sys.executable} {script}",
    )
    try:
        await asyncio.to_thread(agents.wait_ready, 60)
        async with admitting(js, names):
            await submit_tasks(js, names, [sums, fails], progress=False)
            sessions = await ended(js, names, {sums.task_id, fails.task_id}, 3)

        async def counted() -> bool:
            done = await metric(agents.metrics_url, "sf_agents_tasks_total", outcome="done")
            return done == 2

        await eventually(counted)
        correct = await metric(agents.metrics_url, "sf_agents_attempts_total", outcome="correct")
        failed = await metric(agents.metrics_url, "sf_agents_attempts_total", outcome="failed")
    finally:
        code = await asyncio.to_thread(agents.stop)
    assert code == 0 and "agents stopped" in "".join(agents.output)
    assert (correct, failed) == (2, 1)
    by_id = {s.session_id: s for s in sessions}
    for i in range(2):
        s = by_id[f"{sums.task_id}-{i}"]
        assert s.reward == 1.0 and s.metrics["turns"] == 1  # right on the first turn
        (call,) = await calls(js, names, s.session_id)  # the command named its session
        assert call.model == "tiny"
    failure = by_id[f"{fails.task_id}-0"]
    assert failure.reward == 0.0 and failure.metrics["failed"] == 1.0
    assert await calls(js, names, failure.session_id) == []
    assert "exited 3: refusing on purpose" in "".join(agents.output)
    assert (await js.stream_info(names.tasks_stream)).state.messages == 0


@pytest.mark.newest_nats
@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js 18+ on PATH")
async def test_the_documented_node_agent(stack, js, tok, tmp_path: Path):
    """The Node.js agent of docs/protocol.md, section 10, as written there."""
    doc = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    source = doc.split("```js\n// agent.mjs", 1)[1].split("```", 1)[0]
    script = tmp_path / "agent.mjs"
    script.write_text("// agent.mjs" + source)
    names = stack.names
    task = chat_task(unique("node"), reference="x")
    async with runner(js, names, stack.url, command=["node", str(script)]):
        await submit_tasks(js, names, [task], progress=False)
        (s,) = await ended(js, names, {task.task_id}, 1)
    assert "failed" not in s.metrics and s.metrics["turns"] == 1
    (call,) = await calls(js, names, s.session_id)
    said = tok.decode(call.output_ids, skip_special_tokens=True).replace("\n", " ")
    assert s.reward == (1.0 if exact_match(said, "x") else 0.0)
