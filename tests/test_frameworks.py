"""Agent frameworks, unchanged, on the gateway (``examples/frameworks/``): the OpenAI Agents SDK
(``Agent`` + ``function_tool`` + ``Runner.run``) and LangGraph (``create_react_agent`` on a
``ChatOpenAI``), with only the base URL and the session header set. A real runner runs them on a
real gateway and hf worker; a real trajectory manager makes the samples.

Deterministic: the tiny model is warm-started (``trainer.warmstart``, the repo's own SFT) on
two demonstrations of one task, in the exact form the gateway renders (the Hermes tool template
as the model's own chat template, with each framework's tool schema): "What is 2+3?" answered by
a ``calculator`` call, and the tool's result answered by the number. Decoding is greedy
(temperature 0), so the model calls the tool on its own (``tool_choice`` auto).
"""

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest

from broker.messages import ChatMessage, RewardSpec, SampleReady, TaskSubmitted
from broker.subjects import Durable
from examples.frameworks.calculator import calculate
from rollout.gateway.tools import TEMPLATES, parse_tool_calls
from seamlessflow.submit import submit_tasks
from tests.support import SMALL_RUN, eventually, gateway_stack, stream_messages
from tests.test_agents import calls, ended, runner, unique
from trainer.warmstart import WarmStartConfig, warm_start
from trajectory.config import TrajectoryConfig
from trajectory.manager import TrajectoryManager

pytest.importorskip("agents")
pytest.importorskip("langgraph")

AGENTS = {
    "agents_sdk": "examples.frameworks.agents_sdk_calculator:agent",
    "langgraph": "examples.frameworks.langgraph_calculator:agent",
}
EXPRESSION = "2+3"
QUESTION = f"What is {EXPRESSION}?"
WARM = WarmStartConfig(steps=80, batch_size=8, lr=2e-3)


def tool_schemas() -> list[dict]:
    """The calculator as each framework sends it in ``tools``."""
    from agents.models.chatcmpl_converter import Converter
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from examples.frameworks import agents_sdk_calculator, langgraph_calculator

    return [
        Converter.tool_to_openai(agents_sdk_calculator.calculator),
        convert_to_openai_tool(langgraph_calculator.calculator),
    ]


def call_text(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its chat template the gateway's Hermes tool template, warm-started to
    call the calculator for the question and to answer with the tool's result."""
    from common.models import load_tokenizer

    base = tmp_path_factory.mktemp("models") / "tiny-hermes"
    shutil.copytree(tiny_model_dir, base)
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = (TEMPLATES / "hermes_tools.jinja").read_text()
    tok.save_pretrained(base)

    def system(schema: dict) -> str:  # the tools block, as the gateway renders it
        text = tok.apply_chat_template(
            [{"role": "user", "content": "-"}], tools=[schema], tokenize=False
        )
        return text[len("<|im_start|>system\n") : text.index("<|im_end|>")]

    systems = [system(s) for s in tool_schemas()]
    arguments = json.dumps({"expression": EXPRESSION})

    def demonstration(rng: random.Random):
        messages = [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": QUESTION},
        ]
        if rng.random() < 0.5:
            return messages, call_text(arguments)
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "calculator", "arguments": arguments},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": calculate(EXPRESSION)},
        ]
        return messages, calculate(EXPRESSION)

    return warm_start(base, WARM, demonstration, "frameworks-calculator", cache=base.parent)


@pytest.fixture(scope="module")
def tool_stack(broker, tool_model_dir: Path):
    with gateway_stack(broker.url, tool_model_dir, "--max-model-len", "1024") as stack:
        yield stack


@pytest.mark.newest_nats
@pytest.mark.timeout(600)  # the first one builds the warm-started model (about 1-4 min of CPU)
@pytest.mark.parametrize("framework", sorted(AGENTS))
async def test_a_framework_agent_is_recorded_token_exact(framework, tool_stack, js, tool_model_dir):
    from common.models import load_tokenizer

    tok = load_tokenizer(tool_model_dir)
    names = tool_stack.names
    task = TaskSubmitted(
        task_id=unique(framework),
        messages=[ChatMessage(role="user", content=QUESTION)],
        env="chat",
        reward=RewardSpec(verifier="number", reference=calculate(EXPRESSION)),
    )
    stop = asyncio.Event()
    manager = TrajectoryManager(js, names, SMALL_RUN.traj, TrajectoryConfig(concurrency=1))
    managing = asyncio.create_task(manager.run(stop))
    try:
        async with runner(
            js, names, tool_stack.url, agent=AGENTS[framework], temperature=0.0, max_tokens=48
        ):
            await submit_tasks(js, names, [task], progress=False)
            (session,) = await ended(js, names, {task.task_id}, 1)

        async def settled() -> bool:
            info = await js.consumer_info(names.traj_stream, Durable.TRAJECTORY)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await eventually(settled, timeout=60, watch=managing)
    finally:
        stop.set()
        await asyncio.wait_for(managing, 30)

    # The framework ran the tool once and gave the model's answer after it.
    recorded = await calls(js, names, session.session_id)
    said = [tok.decode(c.output_ids) for c in recorded]
    assert "failed" not in session.metrics, (session.metrics, said)
    assert session.metrics["tool_calls"] == 1 and session.metrics["turns"] == 2, (
        session.metrics,
        said,
    )
    assert session.reward == 1.0, (session, said)
    first, second = recorded
    # Turn 1: the model wrote the call (all of it output, in Hermes' form).
    prompt_text = tok.decode(first.prompt_ids)
    assert prompt_text.endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" in prompt_text
    content, parsed = parse_tool_calls(tok.decode(first.output_ids, skip_special_tokens=True))
    assert content == ""
    (call,) = parsed
    expression = json.loads(call.function.arguments)["expression"]
    assert expression == EXPRESSION
    # Turn 2 extends turn 1 token for token: prompt + output ids, then the tool's result (what
    # the Python tool returned for the parsed arguments) and the generation prompt.
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
    # the tool's result out.
    (sample,) = [
        s
        for s in await stream_messages(js, names.samples_stream, SampleReady)
        if s.session_id == session.session_id
    ]
    assert sample.token_ids == [*second.prompt_ids, *second.output_ids]
    n1, n2 = len(first.prompt_ids), len(second.prompt_ids)
    mask = sample.loss_mask
    assert mask[:n1] == [0] * n1
    assert mask[n1 : len(path)] == [1] * len(first.output_ids)
    assert mask[len(path) : n2] == [0] * (n2 - len(path))
    assert mask[n2:] == [1] * len(second.output_ids)
    assert sample.logprobs[n1 : len(path)] == first.output_logprobs
