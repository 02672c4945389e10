"""Sessions run by a real agent runner with a real trajectory manager on a stack (``run_sessions``),
and the checks that a tool session on the tool stack (``tool_stack``, ``tool_model_dir`` in
``tests/conftest.py``) was recorded token-exact: shared by the framework, built-in and TypeScript
tool agents' tests (and the multi-agent one's runs)."""

import json

from broker.messages import CallRecorded, SampleReady, SessionEnded, TaskSubmitted
from broker.subjects import Durable
from rollout.agents.calculator import calculate
from rollout.gateway.tools import parse_tool_calls
from seamlessflow.submit import submit_tasks
from tests.conftest import TOOL_EXPRESSION, TOOL_QUESTION
from tests.support import building, consumer_settled, eventually, stream_messages
from tests.test_agents import calls, ended, runner


async def run_sessions(
    js, stack, tasks: list[TaskSubmitted], count: int, **runner_fields
) -> tuple[list[SessionEnded], list[SampleReady]]:
    """Run ``tasks`` with an agent runner configured by ``runner_fields`` and a trajectory
    manager until their ``count`` sessions have ended and the samples are out: the sessions'
    ``SessionEnded`` and every sample of the run."""
    names = stack.names
    async with building(js, names) as managing:
        async with runner(js, names, stack.url, **runner_fields):
            await submit_tasks(js, names, tasks, progress=False)
            sessions = await ended(js, names, {t.task_id for t in tasks}, count)

        await eventually(
            lambda: consumer_settled(js, names.traj_stream, Durable.TRAJECTORY),
            timeout=60,
            watch=managing,
        )
    return sessions, await stream_messages(js, names.samples_stream, SampleReady)


async def run_session(
    js, stack, task: TaskSubmitted, **runner_fields
) -> tuple[SessionEnded, list[CallRecorded], list[SampleReady]]:
    """``run_sessions`` of one task of one attempt: its ``SessionEnded``, calls and samples."""
    (session,), samples = await run_sessions(js, stack, [task], 1, **runner_fields)
    recorded = await calls(js, stack.names, session.session_id)
    return session, recorded, [s for s in samples if s.session_id == session.session_id]


def check_tool_session(
    tok, session: SessionEnded, recorded: list[CallRecorded], samples: list[SampleReady]
) -> None:
    """The model called the calculator for ``TOOL_QUESTION`` and answered with its result, and
    every turn is token-exact: the second prompt is the first prompt + output ids, then the
    tool's result; one sample, the model's tokens in the loss, the prompt and the result out."""
    said = [tok.decode(c.output_ids) for c in recorded]
    assert "failed" not in session.metrics, (session.metrics, said)
    assert session.reward == 1.0, (session, said)
    first, second = recorded
    # Turn 1: the model wrote the call (all of it output, in Hermes' form).
    prompt_text = tok.decode(first.prompt_ids)
    assert prompt_text.endswith(f"{TOOL_QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" in prompt_text
    content, parsed = parse_tool_calls(tok.decode(first.output_ids, skip_special_tokens=True))
    assert content == ""
    (call,) = parsed
    expression = json.loads(call.function.arguments)["expression"]
    assert expression == TOOL_EXPRESSION
    # Turn 2 extends turn 1 token for token: prompt + output ids, then the tool's result (what
    # the tool returned for the parsed arguments) and the generation prompt.
    path = [*first.prompt_ids, *first.output_ids]
    assert second.prompt_ids[: len(path)] == path
    added = tok.decode(second.prompt_ids[len(path) :])
    result = calculate(expression)
    assert added == (
        f"\n<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ), added
    assert tok.decode(second.output_ids, skip_special_tokens=True).strip() == result
    # One sample (one leaf): the model's tokens (tool call, answer) in the loss, the prompt and
    # the tool's result out; the attempt's reward.
    (sample,) = samples
    assert sample.reward == session.reward
    assert sample.token_ids == [*second.prompt_ids, *second.output_ids]
    n1, n2 = len(first.prompt_ids), len(second.prompt_ids)
    mask = sample.loss_mask
    assert mask[:n1] == [0] * n1
    assert mask[n1 : len(path)] == [1] * len(first.output_ids)
    assert mask[len(path) : n2] == [0] * (n2 - len(path))
    assert mask[n2:] == [1] * len(second.output_ids)
    assert sample.logprobs[n1 : len(path)] == first.output_logprobs
