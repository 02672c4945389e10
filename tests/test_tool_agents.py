"""The calculator tool env (``rollout/agents/calculator.py``, issue 23 item 4) and the same agent
in TypeScript with the official ``openai`` npm package (``examples/typescript/``, item 7).

Pure: the tool, its tasks, and the warm start's demonstrations, which must render exactly as the
gateway renders the real conversation (SmolLM2's own template on the plain form, the Hermes tool
template on the real one). On the tool stack (a real gateway and hf worker serving the tiny
model warm-started on calculator calls, ``tool_model_dir``), a real agent runner runs the
built-in agent, with the tool offered and without, and the TypeScript agent as its command;
each tool session is checked token-exact with its reward (``tests/tool_sessions.py``).
"""

import json
import random
import shutil
from pathlib import Path

import pytest

from broker.messages import ChatMessage, RewardSpec
from rollout.agents import calculator
from rollout.agents.calculator import TOOL, calculate, calculator_task, run_tool
from rollout.agents.verifiers import last_number
from rollout.gateway.prompts import render_chat
from rollout.gateway.tools import chatml_tools_system, load_tool_template
from tests.conftest import TOOL_EXPRESSION, TOOL_QUESTION
from tests.test_agents import unique
from tests.test_gateway_tools import SMOLLM2_TEMPLATE
from tests.tool_sessions import check_tool_session, run_session

TS_DIR = Path(__file__).parents[1] / "examples" / "typescript"
TSX = TS_DIR / "node_modules" / ".bin" / "tsx"
TS_COMMAND = [str(TSX), str(TS_DIR / "calculator_agent.ts")]


# -- pure ------------------------------------------------------------------------------------


def test_the_tool_evaluates_arithmetic_and_explains_what_it_cannot():
    assert calculate("347*58") == str(347 * 58)
    assert calculate("(4*5)-1") == "19" and calculate("7/2") == "3.5"
    for bad in ("1/0", "2+", "__import__('os')", "2**99999"):
        assert calculate(bad).startswith("error:"), bad
    assert run_tool('{"expression": "12*3"}') == "36"
    for bad in ("12*3", '{"x": "1"}', '["1+1"]', '{"expression": 5}'):
        assert run_tool(bad).startswith("error:"), bad


def test_tasks_multiply_a_three_digit_by_a_two_digit_number():
    tasks = calculator.calculator_tasks(
        random.Random(0), 50, group_size=8, max_turns=2, prefix="t", tools=False
    )
    assert len({t.task_id for t in tasks}) == 50
    for task in tasks:
        a, b = int(task.metadata["a"]), int(task.metadata["b"])
        assert 100 <= a <= 999 and 10 <= b <= 99
        assert task.messages[0].content == f"What is {a}*{b}?"
        assert last_number(f"The answer is {a * b}.", task.reward.reference)
        assert task.metadata["tools"] == calculator.NO_TOOLS and task.env == calculator.ENV


def test_demonstrations_render_as_the_gateway_renders_the_conversation(tok):
    # The warm start renders the plain form with SmolLM2's own template; the gateway renders
    # the agent's real messages (tools, tool_calls, a tool result) with the Hermes template.
    hermes = load_tool_template("hermes")
    system = chatml_tools_system(tok, [TOOL], hermes)
    rng = random.Random(1)
    kinds = set()
    for _ in range(12):
        messages, reply = calculator.demonstration(rng, system)
        plain = tok.apply_chat_template(
            [*messages, {"role": "assistant", "content": reply}],
            tokenize=False,
            chat_template=SMOLLM2_TEMPLATE,
        )
        question = messages[1]
        a, b = (int(x) for x in question["content"][len("What is ") : -1].split("*"))
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a}*{b}"})},
        }
        real = [question]
        if len(messages) == 2:  # the question, answered by the call
            real.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # the call's result, answered by the number
            result = calculate(f"{a}*{b}")
            real += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": result},
                {"role": "assistant", "content": result},
            ]
        kinds.add(len(messages))
        assert plain == render_chat(tok, real, [TOOL], generation_prompt=False, template=hermes)
    assert kinds == {2, 4}


# -- on the tool stack ---------------------------------------------------------------------


def tool_task(*, tools: bool):
    """A calculator task on the question the tiny tool model was warm-started on."""
    task = calculator_task(unique("calc"), 2, 3, group_size=1, max_turns=2, tools=tools)
    return task.model_copy(
        update={
            "messages": [ChatMessage(role="user", content=TOOL_QUESTION)],
            "reward": RewardSpec(verifier="last_number", reference=calculate(TOOL_EXPRESSION)),
        }
    )


@pytest.mark.newest_nats
@pytest.mark.timeout(600)  # the first one may build the warm-started model
async def test_the_builtin_agent_runs_the_tool_and_counts_its_calls(tool_stack, js, tool_model_dir):
    from common.models import load_tokenizer

    tok = load_tokenizer(tool_model_dir)
    session, recorded, samples = await run_session(
        js, tool_stack, tool_task(tools=True), temperature=0.0
    )
    assert session.metrics["tool_calls"] == 1 and session.metrics["tool_errors"] == 0, session
    check_tool_session(tok, session, recorded, samples)
    # The baseline: no tool offered, none in the prompt, no call made.
    session, recorded, _ = await run_session(
        js, tool_stack, tool_task(tools=False), temperature=0.0
    )
    assert session.metrics["tool_calls"] == 0 and len(recorded) == 1, session
    assert "<tools>" not in tok.decode(recorded[0].prompt_ids)


@pytest.mark.newest_nats
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    shutil.which("node") is None or not TSX.is_file(),
    reason="needs Node.js and `npm ci --prefix examples/typescript` (make test does both)",
)
async def test_the_typescript_agent_is_recorded_token_exact(tool_stack, js, tool_model_dir):
    from common.models import load_tokenizer

    session, recorded, samples = await run_session(
        js, tool_stack, tool_task(tools=True), command=TS_COMMAND, temperature=0.0, max_tokens=48
    )
    check_tool_session(load_tokenizer(tool_model_dir), session, recorded, samples)
