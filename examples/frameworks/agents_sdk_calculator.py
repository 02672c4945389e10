"""The OpenAI Agents SDK, unchanged, on the gateway: an ``agents.Agent`` with a function tool,
run by ``Runner.run`` on an ``OpenAIChatCompletionsModel``. Only the client differs from a run
against OpenAI: its base URL is the gateway's, and it names the attempt's session in a header.

    PYTHONPATH=. seamlessflow agents --agent examples.frameworks.agents_sdk_calculator:agent ...

(``examples`` is no installed package: run from the repository root with it on ``PYTHONPATH``.)
The model chooses when to call the tool (``tool_choice`` is left to the default, ``auto``); to
force the first call, set ``ModelSettings(tool_choice="calculator")`` (the SDK's
``reset_tool_choice``, on by default, frees the following turns).
Needs the ``agents-frameworks`` extra. Tracing (uploads to OpenAI) is off.
"""

import os

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallOutputItem
from openai import AsyncOpenAI

from rollout.agents.agents import AgentContext, AgentResult
from rollout.agents.calculator import DESCRIPTION, calculate

set_tracing_disabled(True)
MAX_TURNS = 4


@function_tool(name_override="calculator", description_override=DESCRIPTION)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. 2+3.
    """
    return calculate(expression)


async def agent(ctx: AgentContext) -> AgentResult:
    async with AsyncOpenAI(
        base_url=ctx.gateway_url,
        api_key=ctx.api_key,
        default_headers=ctx.headers,
        max_retries=0,
    ) as client:  # closed with the task: one left open is closed on a later, other event loop
        solver = Agent(
            name="calculator-agent",
            tools=[calculator],
            model=OpenAIChatCompletionsModel(model=ctx.model, openai_client=client),
            model_settings=ModelSettings(temperature=ctx.temperature, max_tokens=ctx.max_tokens),
        )
        question = ctx.task.messages[-1].content or ""
        result = await Runner.run(solver, question, max_turns=MAX_TURNS)
    tool_results = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    return AgentResult(
        answer=str(result.final_output or ""),
        turns=len(result.raw_responses),
        metrics={"tool_calls": float(len(tool_results))},
    )
