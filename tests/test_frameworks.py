"""Agent frameworks, unchanged, on the gateway (``examples/frameworks/``): the OpenAI Agents SDK
(``Agent`` + ``function_tool`` + ``Runner.run``) and LangGraph (``create_react_agent`` on a
``ChatOpenAI``), with only the base URL and the session header set. A real runner runs them on a
real gateway and hf worker; a real trajectory manager makes the samples. And a forced call
(``tool_choice`` required or named) comes back a valid call.

Deterministic: the tiny model is warm-started (``tool_model_dir`` in ``tests/conftest.py``) on
one task in the exact form the gateway renders, with each framework's tool schema: "What is
2+3?" answered by a ``calculator`` call, and the tool's result answered by the number. Decoding
is greedy (temperature 0), so the model calls the tool on its own (``tool_choice`` auto).
"""

import json

import pytest

from broker.messages import ChatMessage, RewardSpec, TaskSubmitted
from broker.subjects import SESSION_HEADER
from rollout.agents.calculator import calculate
from tests.conftest import TOOL_EXPRESSION as EXPRESSION
from tests.conftest import TOOL_QUESTION as QUESTION
from tests.conftest import tool_schemas
from tests.support import MODEL
from tests.test_agents import unique
from tests.tool_sessions import check_tool_session, run_session

pytest.importorskip("agents")
pytest.importorskip("langgraph")

AGENTS = {
    "agents_sdk": "examples.frameworks.agents_sdk_calculator:agent",
    "langgraph": "examples.frameworks.langgraph_calculator:agent",
}


@pytest.mark.newest_nats
@pytest.mark.timeout(600)  # the first one builds the warm-started model (about 1-4 min of CPU)
@pytest.mark.parametrize("framework", sorted(AGENTS))
async def test_a_framework_agent_is_recorded_token_exact(framework, tool_stack, js, tool_model_dir):
    from common.models import load_tokenizer

    tok = load_tokenizer(tool_model_dir)
    task = TaskSubmitted(
        task_id=unique(framework),
        messages=[ChatMessage(role="user", content=QUESTION)],
        env="chat",
        reward=RewardSpec(verifier="number", reference=calculate(EXPRESSION)),
    )
    session, recorded, samples = await run_session(
        js, tool_stack, task, agent=AGENTS[framework], temperature=0.0, max_tokens=48
    )
    # The framework ran the tool once and gave the model's answer after it.
    assert session.metrics.get("tool_calls") == 1 and session.metrics["turns"] == 2, session
    check_tool_session(tok, session, recorded, samples)


@pytest.mark.newest_nats
@pytest.mark.timeout(600)  # the first one may build the warm-started model
@pytest.mark.parametrize("choice", ["required", "named"])
async def test_a_forced_call_is_a_valid_call(choice, tool_stack, openai_client):
    """``tool_choice`` required or named: the gateway prefills the call's start (as prompt
    ids); the model writes the rest, and the client gets a call it can run."""
    client = openai_client(tool_stack.url)
    forced = (
        "required"
        if choice == "required"
        else {
            "type": "function",
            "function": {"name": "calculator"},
        }
    )
    for schema in tool_schemas():
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            tools=[schema],
            tool_choice=forced,
            temperature=0.0,
            max_tokens=48,
            extra_headers={SESSION_HEADER: unique(f"forced-{choice}")},
        )
        message = reply.choices[0].message
        assert message.tool_calls, (schema, message)
        (call,) = message.tool_calls
        assert call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": EXPRESSION}, message
        assert reply.choices[0].finish_reason == "tool_calls"
    await client.close()
