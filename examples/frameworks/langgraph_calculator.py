"""LangGraph, unchanged, on the gateway: the prebuilt ReAct agent (``create_react_agent``) with
a ``ChatOpenAI`` whose only changes are the base URL (the gateway's) and a header naming the
attempt's session.

    PYTHONPATH=. seamlessflow agents --agent examples.frameworks.langgraph_calculator:agent ...

(``examples`` is no installed package: run from the repository root with it on ``PYTHONPATH``.)
The model chooses when to call the tool (``tool_choice`` auto). To force the first call, pass
a dynamic model to ``create_react_agent``: ``llm.bind_tools(tools, tool_choice="calculator")``
until a ``ToolMessage`` is in the state, ``llm.bind_tools(tools)`` after. Needs the
``agents-frameworks`` extra.
"""

import warnings

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from rollout.agents.agents import AgentContext, AgentResult
from rollout.agents.calculator import DESCRIPTION, calculate

with warnings.catch_warnings():  # moved to langchain.agents.create_agent in LangGraph 1.0
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

MAX_STEPS = 8
"""LangGraph's recursion limit: model and tool steps together."""


@tool("calculator", description=DESCRIPTION)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculate(expression)


async def agent(ctx: AgentContext) -> AgentResult:
    llm = ChatOpenAI(
        model=ctx.model,
        base_url=ctx.gateway_url,
        api_key=ctx.api_key,
        default_headers=ctx.headers,
        temperature=ctx.temperature,
        max_tokens=ctx.max_tokens,
        max_retries=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = create_react_agent(llm, [calculator])
    question = ctx.task.messages[-1].content or ""
    state = await graph.ainvoke({"messages": [("user", question)]}, {"recursion_limit": MAX_STEPS})
    replies = [m for m in state["messages"] if isinstance(m, AIMessage)]
    tool_results = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    return AgentResult(
        answer=str(replies[-1].content) if replies else "",
        turns=len(replies),
        metrics={"tool_calls": float(len(tool_results))},
    )
