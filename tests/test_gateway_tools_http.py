"""Tools over HTTP: the real gateway on a real nats-server, called with the official ``openai``
SDK, on a copy of the tiny model that carries SmolLM2-135M-Instruct's chat template (no tools).
The worker's side is played by ``InjectedWorkerWire`` (a fake worker, named as such): the random
tiny model writes no tool call on demand. Pure tests of tools: ``tests/test_gateway_tools.py``.
"""

import asyncio
import itertools
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import codec
from broker.messages import CallRecorded
from rollout.gateway import Gateway
from rollout.gateway.tools import parse_tool_calls
from tests.support import MODEL, InjectedWorkerWire, gateway_config, metric
from tests.test_gateway_fidelity import ask, continues, session_id
from tests.test_gateway_tools import (
    ARGUMENTS,
    PROPERTY,
    QUESTION,
    SMOLLM2_TEMPLATE,
    TOOLS,
    hermes_call,
    named,
)

pytestmark = pytest.mark.newest_nats

# -- the gateway ----------------------------------------------------------------------------

FORCED_START = {
    "required": '<tool_call>\n{"name": "',
    "named": '<tool_call>\n{"name": "calculator", "arguments":',
}
FOLLOW_UP = {"role": "user", "content": "Go on."}


@pytest.fixture(scope="module")
def smol_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with SmolLM2-135M-Instruct's chat template, which renders no tools."""
    from common.models import load_tokenizer

    target = tmp_path_factory.mktemp("models") / "tiny-smollm2-template"
    shutil.copytree(tiny_model_dir, target)
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    tokenizer.save_pretrained(target)
    return target


async def test_bad_tool_requests_get_a_400_naming_the_problem(broker, names, smol_model_dir):
    cases = [
        ({"tools": TOOLS}, "tools", "does not render tools"),
        ({"tools": TOOLS, "tool_choice": named("divide")}, "tool_choice", "'divide'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools.0.function.parameters",
            "should be an object",
        ),
    ]
    async with (
        Gateway(gateway_config(smol_model_dir, names.run), broker.url) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        for fields, param, match in cases:
            body = {"model": MODEL, "messages": QUESTION, **fields}
            response = await http.post("/chat/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and match in error["message"], error


def tool_outputs():
    """What the model writes for a tool_choice: (choice, the turn's text from its start,
    whether it is cut by length). Calls in Hermes' form, content before them under auto, and
    texts cut short, with a missing bracket, or with a call to another function than the one
    named or to one not declared."""
    calls = st.lists(
        st.tuples(st.sampled_from(["calculator", "noop"]), ARGUMENTS, st.sampled_from(["\n"])),
        min_size=1,
        max_size=3,
    )

    def text(choice, content, calls, damage):
        if choice == "named":
            calls = [("calculator", *calls[0][1:]), *calls[1:]]
        written = "\n".join(hermes_call(*c) for c in calls)
        if choice in ("auto", "none") and content:
            written = f"{content}\n{written}"
        kind, at = damage
        if kind == "bracket":
            written = written.replace("}}", "}", 1)
        elif kind == "cut":
            written = written[: max(len(FORCED_START["named"]) + 1, int(at * len(written)))]
        elif kind == "other" and choice == "named":  # a call after the forced one, to another
            head, _, tail = written.rpartition('"calculator"')
            written = f'{head}"noop"{tail}' if head.count("<tool_call>") > 1 else written
        elif kind == "other":  # a call to a function the request does not declare
            written = re.sub(r'"name": "\w+"', '"name": "divide"', written, count=1)
        return choice, written, kind == "cut"

    damage = st.tuples(
        st.sampled_from(["none", "none", "bracket", "cut", "other"]), st.floats(0.3, 0.95)
    )
    choice = st.sampled_from(["auto", "required", "named", "none"])
    content = st.text(alphabet="ab .!", max_size=6)
    return st.builds(text, choice, content, calls, damage)


def as_generated(tok, text: str, splits: list[int]) -> list[int]:
    """``text`` as a model may emit it: pieces tokenized on their own (ids that re-tokenizing
    the whole text would merge)."""
    cuts = sorted({0, len(text), *(s % (len(text) + 1) for s in splits)})
    pieces = [text[a:b] for a, b in itertools.pairwise(cuts)]
    return [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]


async def test_tool_sessions_keep_their_token_ids(broker, nc, js, names, smol_model_dir, tok):
    """Every tool_choice, streaming or not: the call comes back as the model wrote it (or as
    content when malformed), a forced start is prompt (never output), and the echo of the
    assistant turn with the tool results gives a next prompt that starts with the previous
    prompt + output ids."""
    loop = asyncio.get_running_loop()
    seen: Counter[str] = Counter()
    config = gateway_config(smol_model_dir, names.run, tool_template="hermes")
    async with Gateway(config, broker.url) as gw, InjectedWorkerWire(nc, js, names) as wire:
        client = openai.OpenAI(base_url=gw.url, api_key="unused", max_retries=0)

        async def answer(ids: list[int], finish: str):
            request = await wire.take()
            await wire.send(request, 0, ids[:3])
            await wire.send(request, 1, ids[3:], finish_reason=finish)
            return request

        def served(messages, ids, finish, **kwargs):
            answering = asyncio.run_coroutine_threadsafe(answer(ids, finish), loop)
            return ask(client, messages, tools=TOOLS, **kwargs), answering.result(30)

        def recorded(sid: str) -> CallRecorded:
            get = js.get_last_msg(names.traj_stream, names.traj_calls(sid))
            stored = asyncio.run_coroutine_threadsafe(get, loop).result(30)
            return codec.decode(CallRecorded, stored.data)

        @settings(PROPERTY, max_examples=50)
        @given(output=tool_outputs(), splits=st.lists(st.integers(0, 400), max_size=8))
        def session(output, splits):
            choice, text, cut = output
            start = FORCED_START.get(choice, "")
            generated = as_generated(tok, text.removeprefix(start), splits)
            ids = generated if cut else [*generated, tok.eos_token_id]
            sid = session_id()
            tool_choice = named("calculator") if choice == "named" else choice
            kwargs = dict(stream=len(splits) % 2 == 1, sid=sid, tool_choice=tool_choice)
            (message, finish), first = served(QUESTION, ids, "length" if cut else "stop", **kwargs)
            record = recorded(sid)
            assert (record.prompt_ids, record.output_ids) == (first.prompt_ids, ids)
            prompt = tok.decode(record.prompt_ids)
            assert prompt.endswith("<|im_start|>assistant\n" + start)  # prompt, not output
            assert json.dumps(TOOLS[0]) in prompt
            calls = check_reply(choice, text, message, finish)

            results = [{"role": "tool", "tool_call_id": c["id"], "content": "21"} for c in calls]
            turn2 = [*QUESTION, message, *results, FOLLOW_UP]
            _, second = served(turn2, [tok.eos_token_id], "stop", stream=False, sid=sid)
            assert continues(second.prompt_ids, first.prompt_ids, record.output_ids)
            seen[choice] += 1
            seen["parallel"] += len(calls) > 1
            seen["malformed"] += not calls and choice != "none"
            seen["content and calls"] += bool(calls and message.get("content"))

        await asyncio.to_thread(session)
        metrics = gw.url.removesuffix("/v1") + "/metrics"
        assert await metric(metrics, "sf_gateway_tool_calls_total") >= seen["parallel"]
        assert await metric(metrics, "sf_gateway_tool_calls_malformed_total") >= seen["malformed"]
    assert len(seen) == 7 and all(seen.values()), seen


def check_reply(choice: str, text: str, message: dict, finish: str) -> list[dict]:
    """The reply to a model that wrote ``text`` is its calls (those ``choice`` keeps) and the
    rest as content, or all of it as content; return the calls."""
    content, expected = parse_tool_calls(text)
    if choice == "none":  # the tools were in the prompt; the output is all content
        content, expected = text, []
    allowed = {"calculator"} if choice == "named" else {"calculator", "noop"}
    expected = [c for c in expected if c.function.name in allowed]
    calls = message.get("tool_calls", [])
    written = [(c.function.name, c.function.arguments) for c in expected]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == written
    if expected:
        assert finish == "tool_calls"
        # content before the calls streams as written; around them it is stripped
        assert message.get("content", "").split() == content.split()
    else:
        assert message["content"] == text
    return calls
