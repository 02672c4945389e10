"""What differs between ``/v1/chat/completions`` and ``/v1/completions``: a formatter per
endpoint turns the one request path's parts into that endpoint's shapes.

A formatter says where the prompt comes from (the chat template, or the client's text or ids),
how the output the client was given reads when the client echoes it in a later prompt, and how
the events of the choices become a response body or stream chunks.
"""

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel

from broker.messages import ToolCall
from rollout.exceptions import InvalidRequestError
from rollout.gateway.choices import Event
from rollout.gateway.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageIn,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaToolCall,
    TokenLogprob,
    Usage,
    new_id,
    now,
    to_json,
)
from rollout.gateway.prompts import echoed_turn, render_chat
from rollout.gateway.tools import (
    ToolPlan,
    ToolSupport,
    forced_start,
    plan_tools,
    with_argument_objects,
)


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def joined_text(events: list[Event]) -> str:
    return "".join(event.text for event in events)


class Format(ABC):
    """One request's endpoint-specific parts. ``prompt_text`` and ``echo`` may render a
    template and run on the gateway's tokenizer thread; the rest runs on the event loop."""

    prompt_param: ClassVar[str]
    """The request field a too-long prompt is blamed on."""
    _id_prefix: ClassVar[str]

    def __init__(self, body: Any, model: str, tokenizer: Any) -> None:
        self.body = body
        self.model = model
        self.tokenizer = tokenizer
        self.id = new_id(self._id_prefix)
        self.created = now()

    # -- the request ----------------------------------------------------------------------

    @property
    @abstractmethod
    def requested_max_tokens(self) -> int | None: ...

    plan: ToolPlan = ToolPlan()
    """The request's tools: how the output's tool calls are read."""
    call_start: str = ""
    """The start of a forced tool call that ends the prompt text (set by ``prompt_text``)."""

    @property
    def client_ids(self) -> list[int] | None:
        """The prompt as the client sent it in ids; None when it is text."""
        return None

    @abstractmethod
    def prompt_text(self) -> str:
        """The prompt text (its ids are built on the session's turns), when not ``client_ids``."""

    @abstractmethod
    def echo(
        self, prompt_text: str, content: str, tool_calls: list[ToolCall], output_ids: list[int]
    ) -> tuple[str, list[int]] | None:
        """The text that follows ``prompt_text`` less ``call_start`` when the client echoes the
        output it was given (``content`` and ``tool_calls``), and the ids that text stands for
        after the prompt's: the output ids (plus any the echo adds). None: an echo cannot be
        recognised."""

    # -- the response ---------------------------------------------------------------------

    @abstractmethod
    def reply(self, events: list[list[Event]], usage: Usage) -> BaseModel:
        """The whole response: each choice's events, in order."""

    def opening(self) -> list[str]:
        """Stream chunks before any output."""
        return []

    @abstractmethod
    def chunk(self, event: Event) -> str | None:
        """The stream chunk of ``event`` (None: nothing to send)."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> str: ...

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class ChatFormat(Format):
    prompt_param = "messages"
    _id_prefix = "chatcmpl"
    body: ChatCompletionRequest

    def __init__(
        self,
        body: ChatCompletionRequest,
        model: str,
        tokenizer: Any,
        end_markers: Mapping[str, int],
        tool_support: ToolSupport,
    ) -> None:
        super().__init__(body, model, tokenizer)
        self.end_markers = end_markers
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        choice = choice.model_dump() if isinstance(choice, BaseModel) else choice
        self.plan = plan_tools(tools, choice, body.parallel_tool_calls, tool_support)
        self.messages = self._for_template(body.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.body.requested_max_tokens

    def prompt_text(self) -> str:
        text = self._render(self.messages)
        if self.plan.forced:
            try:
                self.call_start = forced_start(
                    lambda reply: self._render([*self.messages, reply], generation_prompt=False),
                    text,
                    self.plan,
                    lambda piece: self.tokenizer.encode(piece, add_special_tokens=False),
                )
            except InvalidRequestError:  # the template cannot render a call: nothing to prefill
                self.call_start = ""
        return text + self.call_start

    def _for_template(self, messages: list[ChatMessageIn]) -> list[dict[str, Any]]:
        out = [m.for_template() for m in messages]
        return with_argument_objects(out) if self.plan.argument_objects else out

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = True) -> str:
        plan = self.plan
        return render_chat(
            self.tokenizer, messages, plan.tools, plan.choice, generation_prompt, plan.template
        )

    def echo(
        self, prompt_text: str, content: str, tool_calls: list[ToolCall], output_ids: list[int]
    ) -> tuple[str, list[int]] | None:
        message = _message(content, tool_calls)
        reply = ChatMessageIn(
            role="assistant", content=message.content, tool_calls=message.tool_calls
        )
        rendered = self._render([*self.messages, *self._for_template([reply])], False)
        before_call = prompt_text[: len(prompt_text) - len(self.call_start)]
        return echoed_turn(before_call, rendered, output_ids, self.end_markers)

    def reply(self, events: list[list[Event]], usage: Usage) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=index,
                message=_message(joined_text(parts), parts[-1].tool_calls),
                logprobs=self._logprobs(parts) if self.body.logprobs else None,
                finish_reason=parts[-1].finish_reason,
            )
            for index, parts in enumerate(events)
        ]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self) -> list[str]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.body.n)
        ]

    def chunk(self, event: Event) -> str | None:
        logprobs = self._logprobs([event]) if self.body.logprobs and event.token_ids else None
        if event.finish_reason is not None:
            calls = [
                DeltaToolCall(index=i, **call.model_dump())
                for i, call in enumerate(event.tool_calls)
            ]
            delta = ChatDelta(content=event.text or None, tool_calls=calls or None)
        elif event.text or logprobs:
            delta = ChatDelta(content=event.text)
        else:
            return None
        choice = ChatChunkChoice(
            index=event.index, delta=delta, logprobs=logprobs, finish_reason=event.finish_reason
        )
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return to_json(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
            )
        )

    def _logprobs(self, events: list[Event]) -> ChoiceLogprobs:
        content = []
        for event in events:
            for token_id, logprob in zip(event.token_ids, event.logprobs, strict=True):
                token = self._token(token_id)
                content.append(
                    TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
                )
        return ChoiceLogprobs(content=content)


def _message(content: str, tool_calls: list[ToolCall]) -> AssistantMessage:
    """The assistant message a client is given (non-streaming; a stream adds up to the same)."""
    return AssistantMessage(
        content=content if content or not tool_calls else None, tool_calls=tool_calls or None
    )


class CompletionFormat(Format):
    prompt_param = "prompt"
    _id_prefix = "cmpl"
    body: CompletionRequest

    def __init__(self, body: CompletionRequest, model: str, tokenizer: Any) -> None:
        super().__init__(body, model, tokenizer)
        self._offsets = [0] * body.n
        """Per choice, the text streamed so far (logprobs' text offsets)."""

    @property
    def requested_max_tokens(self) -> int | None:
        return self.body.max_tokens

    @property
    def client_ids(self) -> list[int] | None:
        prompt = self.body.prompt
        return None if isinstance(prompt, str) else list(prompt)

    def prompt_text(self) -> str:
        assert isinstance(self.body.prompt, str)
        return self.body.prompt

    def echo(
        self, prompt_text: str, content: str, tool_calls: list[ToolCall], output_ids: list[int]
    ) -> tuple[str, list[int]]:
        return content, output_ids

    def reply(self, events: list[list[Event]], usage: Usage) -> Completion:
        want_logprobs = self.body.logprobs is not None
        choices = [
            CompletionChoice(
                index=index,
                text=joined_text(parts),
                logprobs=self._logprobs(parts, 0) if want_logprobs else None,
                finish_reason=parts[-1].finish_reason,
            )
            for index, parts in enumerate(events)
        ]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def chunk(self, event: Event) -> str | None:
        if not (event.text or event.token_ids or event.finish_reason):
            return None
        logprobs = None
        if self.body.logprobs is not None and event.token_ids:
            logprobs = self._logprobs([event], self._offsets[event.index])
        self._offsets[event.index] += len(event.text)
        choice = CompletionChoice(
            index=event.index,
            text=event.text,
            logprobs=logprobs,
            finish_reason=event.finish_reason,
        )
        return to_json(
            Completion(id=self.id, created=self.created, model=self.model, choices=[choice])
        )

    def usage_chunk(self, usage: Usage) -> str:
        return to_json(
            Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        )

    def _logprobs(self, events: list[Event], offset: int) -> CompletionLogprobs:
        tokens, logprobs, offsets = [], [], []
        for event in events:
            for token_id, logprob in zip(event.token_ids, event.logprobs, strict=True):
                tokens.append(self._token(token_id))
                logprobs.append(logprob)
                offsets.append(offset)
                offset += len(self.tokenizer.decode([token_id], skip_special_tokens=True))
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets)
