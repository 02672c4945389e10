"""The tool environment ``calculator``: multiply a 3-digit number by a 2-digit one, with a
calculator function the model may call (issue 23, item 4).

A task asks ``f"What is {a}*{b}?"`` in one user message; the reference is ``str(a * b)``, checked
by the ``last_number`` verifier. A small model cannot multiply such numbers in its head; with the
tool it only has to call it and copy the result. The built-in agent offers ``TOOL`` (unless the
task's ``metadata["tools"]`` is ``"none"``: the no-tool baseline), runs each call the model
makes (``calculate``), sends the result back as a ``tool`` message and lets the model go on,
for at most ``max_turns`` model calls; its answer is the last reply's text. Reward: 1.0 right,
else 0.0 (``binary_reward``). The attempt's metrics count the model's tool calls
(``tool_calls``) and those that were not a valid expression (``tool_errors``).

``calculate`` is the tool itself (safe arithmetic, no ``eval``), also what the framework examples
(``examples/frameworks/``) give their agents.
"""

import ast
import json
import operator
import random
from typing import Any

from openai.types.chat import ChatCompletionMessage

from broker.messages import RewardSpec, TaskSubmitted
from rollout.agents.agents import AgentContext, AgentResult, converse, env_task, env_tasks

ENV = "calculator"
PROMPT = "What is {a}*{b}?"
"""The first (user) message, formatted with ``a`` and ``b``."""
VERIFIER = "last_number"
MAX_TOKENS = 48
"""Tokens per model call, unless the task's ``metadata["max_tokens"]`` says otherwise: enough for
a call (about 30 tokens) or a short answer."""
NO_TOOLS = "none"
"""``metadata["tools"]`` of a baseline task: the model is offered no tool."""
FIRST = (100, 999)
SECOND = (10, 99)
"""The operands' ranges: a 3-digit times a 2-digit number."""

NAME = "calculator"
DESCRIPTION = "Evaluate an arithmetic expression such as 2+3 or (4*5)-1."
"""Kept short, as the whole schema: it is in every prompt, and every prompt token is trained."""
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": DESCRIPTION,
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""The calculator as the built-in agent offers it (an OpenAI function tool)."""

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (an int when whole), or an error message the model
    reads as the tool's result."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


def question(a: int, b: int) -> str:
    return PROMPT.format(a=a, b=b)


def expression(a: int, b: int) -> str:
    """What a model that uses the tool well asks it."""
    return f"{a}*{b}"


def calculator_task(
    task_id: str,
    a: int,
    b: int,
    *,
    group_size: int,
    max_turns: int,
    tools: bool = True,
    max_tokens: int = MAX_TOKENS,
) -> TaskSubmitted:
    """The task ``a * b``; the calculator offered unless ``tools`` is False."""
    return env_task(
        task_id,
        ENV,
        question(a, b),
        RewardSpec(verifier=VERIFIER, reference=str(a * b)),
        group_size=group_size,
        max_turns=max_turns,
        max_tokens=max_tokens,
        metadata={"a": str(a), "b": str(b), "tools": NAME if tools else NO_TOOLS},
    )


def calculator_tasks(
    rng: random.Random,
    n: int,
    *,
    group_size: int,
    max_turns: int,
    prefix: str,
    tools: bool = True,
    max_tokens: int = MAX_TOKENS,
) -> list[TaskSubmitted]:
    """``n`` tasks ``<prefix>-<i>``, a 3-digit times a 2-digit number each."""
    return env_tasks(
        n,
        prefix,
        lambda task_id: calculator_task(
            task_id,
            rng.randint(*FIRST),
            rng.randint(*SECOND),
            group_size=group_size,
            max_turns=max_turns,
            tools=tools,
            max_tokens=max_tokens,
        ),
    )


def call_text(expression_text: str) -> str:
    """A calculator call as the Hermes tool template writes it (``rollout.gateway.tools``)."""
    arguments = json.dumps({"expression": expression_text})
    return f'<tool_call>\n{{"name": "{NAME}", "arguments": {arguments}}}\n</tool_call>'


def demonstration(rng: random.Random, system: str) -> tuple[list[dict[str, str]], str]:
    """A warm-start example (``trainer.warmstart``) of using the tool on a random task: the
    question answered by the call, or (half the time) the call's result answered by the number.
    Written as plain ChatML messages that render as the gateway renders the real ones with the
    Hermes tool template: ``system`` is its tools block (``chatml_tools_system``), the call is
    the assistant's text, the result a ``tool`` message in ``<tool_response>`` tags."""
    a, b = rng.randint(*FIRST), rng.randint(*SECOND)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": question(a, b)},
    ]
    if rng.random() < 0.5:
        return messages, call_text(expression(a, b))
    result = calculate(expression(a, b))
    messages += [
        {"role": "assistant", "content": call_text(expression(a, b))},
        {"role": "tool", "content": f"<tool_response>\n{result}\n</tool_response>"},
    ]
    return messages, result


def run_tool(arguments: str) -> str:
    """The calculator's result for a call's ``arguments`` (the JSON text the model wrote), or an
    error message starting ``error:`` for arguments that are not ``{"expression": "<text>"}``."""
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        return f"error: arguments are not JSON: {exc}"
    if not isinstance(parsed, dict) or not isinstance(parsed.get("expression"), str):
        return 'error: arguments must be {"expression": "<text>"}'
    return calculate(parsed["expression"])


async def calculator_agent(ctx: AgentContext) -> AgentResult:
    """Ask with the calculator offered; run each call, send its result, let the model go on;
    the answer is the first reply without a call (or the last reply at ``max_turns``)."""
    offered = ctx.task.metadata.get("tools", NAME) != NO_TOOLS
    tools = {"tools": [TOOL]} if offered else {}
    metrics = {"tool_calls": 0.0, "tool_errors": 0.0}

    async def results(message: ChatCompletionMessage) -> list[dict[str, Any]]:
        answer = [message.model_dump(include={"role", "content", "tool_calls"})]
        for call in message.tool_calls:
            result = run_tool(call.function.arguments)
            metrics["tool_calls"] += 1
            metrics["tool_errors"] += result.startswith("error:")
            answer.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return answer

    message, turns = await converse(
        ctx, results, MAX_TOKENS, done=lambda message: not message.tool_calls, **tools
    )
    return AgentResult(answer=message.content or "", turns=turns, metrics=metrics)
