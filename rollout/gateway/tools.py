"""Tools in the prompt, tool calls out of the output. Pure core (no NATS).

- The prompt: a request's ``tools`` are rendered by the model's chat template when it renders
  tools (probed once: ``renders_tools``), else by the tool template configured for the model
  (``[model] tool_template``; ``hermes`` is shipped, ``templates/hermes_tools.jinja``). With
  neither, a request with tools is refused (400) rather than run with tools the model never sees.
- The output: the configured parser (``[model] tool_parser``; ``hermes`` reads
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) turns tool-call text into OpenAI
  ``tool_calls``; text that does not parse is content (counted as malformed), never an error.
- ``tool_choice``: ``auto`` parses; ``none`` keeps the tools in the prompt (a session's prompts
  keep their common prefix when the choice changes between turns) and parses nothing;
  ``required`` and a named function append the start of a call, as the template writes it, to
  the prompt (``forced_start``): ``<tool_call>`` up to the name (required) or up to the
  arguments (named, or required with one tool), cut back to where a token of the whole call
  ends (a prefill ending in ``{`` where the call's own tokens have ``{"`` would leave the model
  at a token boundary it never wrote a call from, and it breaks the call). Those ids are prompt
  ids (recorded as prompt, never as generated output); the model writes the rest. The client gets
  the prefilled text as part of the call, or of the content when what the model wrote does
  not parse.
- Calls are kept only to functions the request declares (the named one, when named); when none
  is left, the whole text is content.
- Echoed calls: a template that writes ``arguments | tojson`` (Qwen2.5's, Llama 3.1's) gets
  them as objects (probed once: ``wants_argument_objects``), else as the JSON text given.
"""

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.messages import FunctionCall, ToolCall
from common.exceptions import ModelError
from rollout.exceptions import InvalidRequestError
from rollout.gateway.detok import partial_suffix_len
from rollout.gateway.metrics import TOOL_CALLS, TOOL_CALLS_MALFORMED
from rollout.gateway.prompts import render_chat

TEMPLATES = Path(__file__).parent / "templates"
SHIPPED_TEMPLATES = {"hermes": "hermes_tools.jinja"}
"""Tool templates shipped with the gateway, by the name ``tool_template`` gives them."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_PROBE = "sf_probe_function_4b1d"
"""A function name no real template writes on its own (``renders_tools``, ``forced_start``)."""
_PROBE_ARGUMENTS = "sf_probe_arguments_4b1d"


def load_tool_template(spec: str | None) -> str | None:
    """The text of the tool template ``spec``: a shipped one's name, or a Jinja file."""
    if spec is None:
        return None
    path = TEMPLATES / SHIPPED_TEMPLATES[spec] if spec in SHIPPED_TEMPLATES else Path(spec)
    try:
        return path.read_text()
    except OSError as exc:
        shipped = ", ".join(repr(n) for n in SHIPPED_TEMPLATES)
        raise ModelError(
            f"tool_template {spec!r} is neither a shipped template ({shipped}) nor a readable "
            f"file: {exc}"
        ) from exc


@dataclass(frozen=True)
class ToolSupport:
    """How this gateway's model takes tools: its parser, its tool template's text (None: the
    model's chat template) and whether the model's own template renders tools."""

    parser: str = "hermes"
    template: str | None = None
    model_renders_tools: bool = True
    argument_objects: bool = False
    """The template that renders tools writes a call's arguments only when given as an object
    (not the JSON text clients send): echoed calls get their arguments parsed for it."""


def tool_support(tokenizer: Any, parser: str, template_spec: str | None) -> ToolSupport:
    """How the model of ``tokenizer`` takes tools; ``ModelError`` when the configured tool
    template cannot be read or does not render tools."""
    template = load_tool_template(template_spec)
    if template is not None and not renders_tools(tokenizer, template):
        raise ModelError(
            f"tool_template {template_spec!r} does not render tools (or fails to render a "
            "conversation with one)"
        )
    objects = wants_argument_objects(tokenizer, template)
    return ToolSupport(parser, template, renders_tools(tokenizer), objects)


def renders_tools(tokenizer: Any, template: str | None = None) -> bool:
    """Whether the chat template (``template``, else the model's) puts tools in the prompt."""
    tool = {"type": "function", "function": {"name": _PROBE, "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    try:
        return _PROBE in render_chat(tokenizer, messages, [tool], template=template)
    except InvalidRequestError:  # a template that breaks on tools does not render them
        return False


def wants_argument_objects(tokenizer: Any, template: str | None = None) -> bool:
    """Whether the template writes a call's arguments as given only when they are an object
    (it writes ``arguments | tojson``, as Qwen2.5's and Llama 3.1's do: a string would come out
    quoted), where it writes the JSON text as given (the tiny model's, ``hermes``)."""
    text = '{"sf_probe": 1}'
    call = {"role": "assistant", "content": None, "tool_calls": [_call(_PROBE, text)]}
    messages = [{"role": "user", "content": "hi"}, call]
    try:
        if text in render_chat(tokenizer, messages, generation_prompt=False, template=template):
            return False
    except InvalidRequestError:
        pass
    call["tool_calls"] = [_call(_PROBE, json.loads(text))]
    try:
        return '"sf_probe"' in render_chat(
            tokenizer, messages, generation_prompt=False, template=template
        )
    except InvalidRequestError:
        return False


def with_argument_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each call's arguments parsed when they are the JSON text of an
    object (for a template that wants objects); other arguments stay as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_parsed_arguments(c) for c in calls]}
        out.append(message)
    return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments"))
    except (TypeError, ValueError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools: what the template gets, and how the output is read."""

    tools: list[dict[str, Any]] | None = None
    choice: str | dict[str, Any] | None = None
    """``tool_choice`` as the template gets it."""
    template: str | None = None
    """The chat template to render with; None: the model's."""
    parse: bool = False
    forced: bool = False
    """``required`` or a named function: the prompt ends with the start of a call."""
    named: str | None = None
    names: tuple[str, ...] = ()
    """The functions the request declares: calls to others are not calls."""
    parallel: bool = True
    argument_objects: bool = False
    """Give the template calls' arguments as objects (``ToolSupport.argument_objects``)."""


def plan_tools(
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    parallel: bool,
    support: ToolSupport,
) -> ToolPlan:
    """The plan of a request's ``tools`` and ``tool_choice``; ``InvalidRequestError`` (400)
    for a choice that cannot be met."""
    if not tools:
        if choice == "required" or isinstance(choice, dict):
            raise InvalidRequestError(
                f"tool_choice {json.dumps(choice)} needs tools: the request has none",
                param="tool_choice",
            )
        # the model's template renders this request: the one probed, unless a tool template is
        return ToolPlan(
            choice=choice, argument_objects=support.argument_objects and not support.template
        )
    names = [tool["function"]["name"] for tool in tools]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise InvalidRequestError(
            f"tools name the function(s) {dupes} more than once", param="tools"
        )
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    if named is not None and named not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {named!r}, which is not among the tools {names}",
            param="tool_choice",
        )
    if support.template is None and not support.model_renders_tools and choice != "none":
        raise InvalidRequestError(
            "this model's chat template does not render tools, so the model would never see "
            "them: the gateway needs a tool template for it ([model] tool_template, e.g. "
            "'hermes')",
            param="tools",
        )
    forced = choice == "required" or named is not None
    if forced and support.parser == "none":
        raise InvalidRequestError(
            f"tool_choice {json.dumps(choice)} needs a tool-call parser; this gateway has "
            "tool_parser 'none'",
            param="tool_choice",
        )
    if choice == "required" and len(names) == 1:
        named = names[0]  # the one function there is: the call is that one's
    return ToolPlan(
        tools=tools,
        choice=choice,
        template=support.template,
        parse=choice != "none" and support.parser != "none",
        forced=forced,
        named=named,
        names=tuple(names),
        parallel=parallel,
        argument_objects=support.argument_objects,
    )


def forced_start(
    render_reply: Callable[[dict[str, Any]], str],
    prompt: str,
    plan: ToolPlan,
    tokenize: Callable[[str], list[int]],
) -> str:
    """The text a forced call starts with, exactly as the template writes a call after
    ``prompt``: up to the arguments (a named function whose arguments the template writes as
    given) or up to the name, ending where a token of the whole call ends (``token_aligned``).
    ``render_reply(message)`` renders the conversation with the assistant ``message`` appended;
    ``tokenize`` is the gateway's (no special tokens added). Empty when the template's form of
    a call is not Hermes' (then nothing is prefilled: the choice is asked of the model only)."""
    start = _forced_text(render_reply, prompt, plan)
    if not start:
        return ""
    # The whole call as the model would write it (a declared name; arguments with a key).
    turn = _after(render_reply(_call_reply(plan.named or plan.names[0], '{"x": 1}')), prompt)
    aligned = token_aligned(start, turn, tokenize)
    if plan.named is not None and plan.named not in aligned:
        aligned = ""  # the name itself would be cut: prefill nothing rather than half of it
    return _checked(aligned, plan.named)


def _forced_text(render_reply: Callable[[dict[str, Any]], str], prompt: str, plan: ToolPlan) -> str:
    """``forced_start``'s text before token alignment."""
    name = plan.named or _PROBE
    if plan.named is not None:
        turn = _after(render_reply(_call_reply(name, _PROBE_ARGUMENTS)), prompt)
        at = turn.find(_PROBE_ARGUMENTS)
        if at > 0 and turn[at - 1] != '"':  # the arguments' text, not a JSON string of it
            return _checked(turn[:at] + "{", name)  # arguments are a JSON object
    turn = _after(render_reply(_call_reply(name, "{}")), prompt)
    at = turn.find(name)
    if at < 0:
        return ""
    return _checked(turn[: at + len(name)] if plan.named else turn[:at], plan.named)


def token_aligned(start: str, turn: str, tokenize: Callable[[str], list[int]]) -> str:
    """The longest prefix of ``start`` (which ``turn`` starts with) whose tokens are the first
    tokens of ``turn``'s: the model continues such a prefill as it would have written the
    turn itself. Empty when no prefix is."""
    ids = tokenize(turn)
    for end in range(len(start), 0, -1):
        head = tokenize(start[:end])
        if ids[: len(head)] == head:
            return start[:end]
    return ""


def _call_reply(name: str, arguments: str) -> dict[str, Any]:
    """An assistant message with one call, as a client echoes it (content null)."""
    return {"role": "assistant", "content": None, "tool_calls": [_call(name, arguments)]}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": "call_0", "type": "function", "function": function}


def _after(rendered: str, prompt: str) -> str:
    return rendered[len(prompt) :] if rendered.startswith(prompt) else ""


def _checked(start: str, name: str | None) -> str:
    """``start`` if a Hermes call begins there (a forced call is prefilled from its tag on)."""
    if not start.startswith(TOOL_CALL_OPEN) or TOOL_CALL_CLOSE in start:
        return ""
    if name is None and "arguments" in start:
        return ""  # the template writes arguments first: the name is not the model's to pick
    return start


# -- Hermes tool calls ----------------------------------------------------------------------

_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes-style tool calls in ``text``: (the text outside them, stripped; the calls). When
    there is none, or one is not a JSON object with a ``name``, the text is plain content."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        call = _tool_call(match.group(1).strip())
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip(), calls


def _tool_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        arguments = args
    elif isinstance(args, dict):
        arguments = _arguments_as_written(body, args)
    else:
        return None
    if len(obj["name"]) > 256 or len(arguments) > 1 << 20:
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=obj["name"], arguments=arguments),
    )


def _arguments_as_written(body: str, args: dict[str, Any]) -> str:
    """The arguments' JSON text exactly as the model wrote it, so that an agent echoing the call
    renders the same text again (and the prompt reuses the generated ids)."""
    key = _ARGUMENTS_KEY.search(body)
    if key is not None:
        try:
            value, end = json.JSONDecoder().raw_decode(body, key.end())
        except ValueError:
            value = None
        if value == args:
            return body[key.end() : end]
    return json.dumps(args)


class ToolCallStream:
    """Streamed content with tool calls: text is passed on until a ``<tool_call>`` may begin;
    from there on it is held and parsed when the output ends. ``start`` is a forced call's
    prefilled start, read before the output."""

    def __init__(self, start: str = "") -> None:
        self._held = ""
        self._in_call = False
        self.feed(start)  # a forced start begins with the tag: it is no content

    def feed(self, text: str) -> str:
        """Content that can be streamed now."""
        if self._in_call:
            self._held += text
            return ""
        text = self._held + text
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._in_call = True
            self._held = text[start:]
            return text[:start]
        cut = len(text) - partial_suffix_len(text, (TOOL_CALL_OPEN,))
        self._held = text[cut:]
        return text[:cut]

    def finish(self, plan: ToolPlan | None = None) -> tuple[str, list[ToolCall]]:
        """The rest of the content, and the tool calls found in it that ``plan`` keeps: those to
        its functions (only the named one's, when named), only the first unless parallel; none
        kept: the whole text is content. Counts calls and malformed text."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        content, calls = parse_tool_calls(held)
        if plan is not None and (plan.named or plan.names):
            allowed = {plan.named} if plan.named else set(plan.names)
            calls = [call for call in calls if call.function.name in allowed]
        if not calls:
            TOOL_CALLS_MALFORMED.inc()
            return held, []
        if plan is not None and not plan.parallel:
            calls = calls[:1]
        TOOL_CALLS.inc(len(calls))
        return content, calls


def chatml_tools_system(tokenizer: Any, tools: list[dict[str, Any]], template: str | None) -> str:
    """The system message text a ChatML template (``template``, else the model's) renders for
    ``tools`` when the conversation has no system message of its own: what a warm start writes as
    a plain system message so that its prompts are the gateway's. ``ModelError`` for a template
    that is not ChatML."""
    head = "<|im_start|>system\n"
    text = render_chat(tokenizer, [{"role": "user", "content": "-"}], tools, template=template)
    if not text.startswith(head) or "<|im_end|>" not in text:
        raise ModelError("the chat template is not ChatML: no tools system message to write")
    return text[len(head) : text.index("<|im_end|>")]
