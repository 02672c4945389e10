"""The OpenAI-compatible gateway: HTTP for agents, token ids to rollout workers over NATS.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not, ``n`` choices),
``GET /v1/models``, ``GET /metrics``, ``GET /health``. A request is handled in four steps:

1. validate it (``rollout.openai_api``) and find its session: header ``X-Session-Id``, else the
   ``user`` field, else a fresh id;
2. render the chat template and build the prompt ids on the session's earlier turns
   (``rollout.prompts``: echoed assistant text reuses the generated ids);
3. run one ``rollout.calls.Call`` per choice, each in its own task, detokenizing its tokens
   (``rollout.detok``) with stop strings and tool-call parsing;
4. answer (JSON, or SSE as the tokens arrive) and remember each finished turn for the session.

Errors are OpenAI-style bodies ``{"error": {"message", "type", "param", "code"}}``, counted in
``sf_gateway_errors_total`` and logged.
"""

import asyncio
import contextlib
import logging
import re
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from broker.client import connect, disconnect
from broker.codec import describe
from broker.messages import FinishReason, SamplingParams, ToolCall
from broker.subjects import NAME_PATTERN, RunNames
from common.exceptions import ModelError
from common.log import kv
from common.metrics import process_registry
from common.models import eos_token_ids, load_tokenizer, model_info
from rollout.calls import ERRORS, Call, CallLimits
from rollout.calls import REGISTRY as CALL_METRICS
from rollout.detok import Detokenizer
from rollout.exceptions import (
    ClientDisconnectedError,
    ContextLengthError,
    GenerationFailedError,
    GenerationUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    RecordUnavailableError,
    RolloutError,
)
from rollout.openai_api import (
    SESSION_HEADER,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaToolCall,
    ErrorBody,
    ErrorDetail,
    ModelCard,
    ModelList,
    TokenLogprob,
    ToolCallStream,
    Usage,
    new_id,
    now,
    to_json,
)
from rollout.prompts import Prompt, SessionStore, render_chat

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

REQUESTS = Counter(
    "sf_gateway_requests",
    "HTTP requests by endpoint and status code",
    ["endpoint", "status"],
    registry=REGISTRY,
)
TOKENS_OUT = Counter("sf_gateway_tokens_out", "Tokens generated for clients", registry=REGISTRY)
PROMPT_TOKENS = Counter(
    "sf_gateway_prompt_tokens",
    "Prompt tokens by source: reused (ids of a session's earlier turns), tokenized, or "
    "client_ids (sent as ids)",
    ["source"],
    registry=REGISTRY,
)

_SESSION_ID = re.compile(NAME_PATTERN)
_CONTEXT_IDS = 5
"""Prompt ids the detokenizer sees before the output (word-start markers need them)."""
_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|list|dict|none)$")

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)


class GatewayConfig(CallLimits):
    """The gateway's settings (its call limits included)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=256, description="model name clients use")
    model_path: Path = Field(description="HF model folder (tokenizer, chat template, config)")
    run: str = Field(pattern=NAME_PATTERN, description="run whose gen/traj streams to use")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535, description="0: a free port")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="prompt + output tokens; default: the model's max_position_embeddings",
    )
    stop_token_ids: list[int] | None = Field(
        default=None, description="tokens that end generation; default: the model's eos ids"
    )
    session_cache_sessions: int = Field(default=4096, ge=1, description="sessions remembered")
    session_cache_tokens: int = Field(
        default=16_000_000, ge=1, description="token ids remembered over all sessions"
    )


# -- one choice -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Event:
    """Part of one choice's output; the last one has ``finish_reason`` or ``error``."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    completion_tokens: int = 0
    error: RolloutError | None = None


@dataclass(frozen=True)
class _ChoiceSpec:
    index: int
    params: SamplingParams
    stop: list[str]
    parse_tools: bool
    parallel_tool_calls: bool = True


# -- the service ----------------------------------------------------------------------------


class OpenAIService:
    """The request handlers; ``build_app`` routes HTTP to them."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Any,
        nc: NATS,
        js: JetStreamContext,
        max_model_len: int,
        stop_token_ids: list[int],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.nc = nc
        self.js = js
        self.names = RunNames(config.run)
        self.max_model_len = max_model_len
        self.stop_token_ids = stop_token_ids
        self.sessions = SessionStore(config.session_cache_sessions, config.session_cache_tokens)
        self._tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        """Cancel the calls still running (each is cancelled on its worker and recorded)."""
        for task in self._tasks:
            if not task.cancelling():  # a second cancel would cut short its record's publish
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- endpoints ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = _parse(ChatCompletionRequest, await request.body())
        self._check_model(body.model)
        session_id = _session_id(request, body.user)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        tool_choice = (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, BaseModel)
            else body.tool_choice
        )
        messages = [m.for_template() for m in body.messages]
        text = render_chat(self.tokenizer, messages, tools, tool_choice)
        prompt = self._prompt(session_id, text)
        max_tokens = self._max_tokens(len(prompt.ids), body.requested_max_tokens, "messages")
        specs = self._specs(body, max_tokens, body.parses_tool_calls, body.parallel_tool_calls)
        want_logprobs = body.logprobs
        run = await self._start(request, session_id, prompt, specs)
        response_id = new_id("chatcmpl")
        if body.stream:
            return _sse(self._chat_stream(run, response_id, body, len(prompt.ids), want_logprobs))
        events = await _unless_disconnected(request, _collect(run, len(specs)))
        choices, completion_tokens = [], 0
        for index, parts in enumerate(events):
            last = parts[-1]
            completion_tokens += last.completion_tokens
            content, tool_calls = _joined_text(parts), last.tool_calls
            choices.append(
                ChatChoice(
                    index=index,
                    message=AssistantMessage(
                        content=content if content or not tool_calls else None,
                        tool_calls=tool_calls or None,
                    ),
                    logprobs=self._chat_logprobs(parts) if want_logprobs else None,
                    finish_reason=last.finish_reason,
                )
            )
        return _json(
            ChatCompletion(
                id=response_id,
                created=now(),
                model=self.config.model,
                choices=choices,
                usage=_usage(len(prompt.ids), completion_tokens),
            )
        )

    async def completions(self, request: Request) -> Response:
        body = _parse(CompletionRequest, await request.body())
        self._check_model(body.model)
        session_id = _session_id(request, body.user)
        if isinstance(body.prompt, str):
            prompt = self._prompt(session_id, body.prompt)
        else:
            prompt = Prompt(ids=list(body.prompt))
            PROMPT_TOKENS.labels("client_ids").inc(len(prompt.ids))
        max_tokens = self._max_tokens(len(prompt.ids), body.max_tokens, "prompt")
        specs = self._specs(body, max_tokens, parse_tools=False)
        want_logprobs = body.logprobs is not None
        run = await self._start(request, session_id, prompt, specs)
        response_id = new_id("cmpl")
        if body.stream:
            return _sse(
                self._completion_stream(run, response_id, body, len(prompt.ids), want_logprobs)
            )
        events = await _unless_disconnected(request, _collect(run, len(specs)))
        choices, completion_tokens = [], 0
        for index, parts in enumerate(events):
            completion_tokens += parts[-1].completion_tokens
            choices.append(
                CompletionChoice(
                    index=index,
                    text=_joined_text(parts),
                    logprobs=self._completion_logprobs(parts, 0) if want_logprobs else None,
                    finish_reason=parts[-1].finish_reason,
                )
            )
        return _json(
            Completion(
                id=response_id,
                created=now(),
                model=self.config.model,
                choices=choices,
                usage=_usage(len(prompt.ids), completion_tokens),
            )
        )

    async def models(self, request: Request) -> Response:
        card = ModelCard(id=self.config.model, created=now(), max_model_len=self.max_model_len)
        return _json(ModelList(data=[card]))

    async def health(self, request: Request) -> Response:
        connected = self.nc.is_connected
        return JSONResponse(
            {"status": "ok" if connected else "unavailable", "nats_connected": connected},
            status_code=200 if connected else 503,
        )

    # -- request steps --------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.config.model:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist; this gateway serves {self.config.model!r}"
            )

    def _prompt(self, session_id: str, text: str) -> Prompt:
        prompt = self.sessions.build(session_id, text, self._tokenize)
        PROMPT_TOKENS.labels("reused").inc(prompt.reused)
        PROMPT_TOKENS.labels("tokenized").inc(len(prompt.ids) - prompt.reused)
        return prompt

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _max_tokens(self, prompt_len: int, requested: int | None, where: str) -> int:
        """``requested``, or all the room left when not given; the context must fit."""
        room = self.max_model_len - prompt_len
        if requested is None and room >= 1:
            return room
        if requested is not None and requested <= room:
            return requested
        if requested is None:
            asked = f"{prompt_len} tokens in the {where}, leaving no room for a completion"
        else:
            asked = (
                f"{prompt_len + requested} tokens ({prompt_len} in the {where}, {requested} in "
                "the completion)"
            )
        raise ContextLengthError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {asked}. Please reduce the length of the {where} or completion.",
            param=where,
        )

    def _specs(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        max_tokens: int,
        parse_tools: bool,
        parallel_tool_calls: bool = True,
    ) -> list[_ChoiceSpec]:
        specs = []
        for index in range(body.n):
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                stop_token_ids=self.stop_token_ids,
                # n choices from one seed would all be the same
                seed=None if body.seed is None else body.seed + index,
            )
            specs.append(
                _ChoiceSpec(index, params, body.stop_strings, parse_tools, parallel_tool_calls)
            )
        return specs

    async def _start(
        self, request: Request, session_id: str, prompt: Prompt, specs: list[_ChoiceSpec]
    ) -> "_Run":
        """Start a task per choice; return once every call was taken by a worker, so that
        errors up to then are HTTP errors."""
        run = _Run(asyncio.Queue())
        for spec in specs:
            call = Call(
                self.nc,
                self.js,
                self.names,
                self.config.model,
                self.config,
                session_id,
                prompt.ids,
                spec.params,
            )
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._run_choice(spec, call, prompt, run.events, started))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            run.tasks.append(task)
            run.started.append(started)
        try:
            outcomes = await _unless_disconnected(
                request, asyncio.gather(*run.started, return_exceptions=True)
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:
            run.cancel()
            raise
        return run

    async def _run_choice(
        self,
        spec: _ChoiceSpec,
        call: Call,
        prompt: Prompt,
        events: asyncio.Queue[_Event],
        started: asyncio.Future[None],
    ) -> None:
        """Run one call to its end, putting its output on ``events``; the last event has the
        finish reason or the error. Remember the turn for the session when it finished."""
        try:
            try:
                await call.start()
            except asyncio.CancelledError:
                started.cancel()
                raise
            except Exception as exc:
                started.set_exception(exc)
                return
            started.set_result(None)
            try:
                last = await self._stream_choice(spec, call, events)
            except RolloutError as exc:
                last = _Event(spec.index, error=exc)
            except Exception as exc:  # a bug here must still end the client's stream
                log.exception(kv("gateway_choice_crashed", call=call.call_id))
                last = _Event(spec.index, error=GenerationFailedError(f"gateway error: {exc!r}"))
        finally:
            try:
                await call.close()
            except RecordUnavailableError as exc:
                last = _Event(spec.index, error=exc)
        try:
            if last.error is None and prompt.text is not None:
                output_text = self.tokenizer.decode(call.output_ids, skip_special_tokens=False)
                self.sessions.record(call.session_id, prompt, output_text, call.output_ids)
        except Exception:  # the turn is not remembered; the client still gets its answer
            log.exception(kv("gateway_session_record_failed", call=call.call_id))
        finally:
            events.put_nowait(last)

    async def _stream_choice(
        self, spec: _ChoiceSpec, call: Call, events: asyncio.Queue[_Event]
    ) -> _Event:
        """Put the call's text on ``events`` as it comes; return the final event."""
        detok = Detokenizer(self.tokenizer, spec.stop, context=call.prompt_ids[-_CONTEXT_IDS:])
        tools = ToolCallStream() if spec.parse_tools else None
        async with contextlib.aclosing(call.tokens()) as stream:
            async for tokens in stream:
                text, kept = "", 0
                for token_id in tokens.ids:
                    delta = detok.feed(token_id)
                    text += delta.text
                    kept += 1
                    if delta.stopped:
                        dropped = len(tokens.ids) - kept
                        call.end(len(call.output_ids) - dropped, reason="stop string matched")
                        break
                TOKENS_OUT.inc(kept)
                text = tools.feed(text) if tools is not None else text
                events.put_nowait(
                    _Event(spec.index, text, tokens.ids[:kept], tokens.logprobs[:kept])
                )
                if detok.stopped:
                    break
        rest = detok.finish()
        tool_calls: list[ToolCall] = []
        if tools is not None:
            streamed = tools.feed(rest)
            held, tool_calls = tools.finish()
            rest = streamed + held
            if not spec.parallel_tool_calls:
                tool_calls = tool_calls[:1]
        if tool_calls:
            finish = "tool_calls"
        else:
            finish = "length" if call.finish_reason is FinishReason.LENGTH else "stop"
        return _Event(
            spec.index,
            rest,
            finish_reason=finish,
            tool_calls=tool_calls,
            completion_tokens=len(call.output_ids),
        )

    # -- streaming ------------------------------------------------------------------------

    async def _chat_stream(
        self,
        run: "_Run",
        response_id: str,
        body: ChatCompletionRequest,
        prompt_tokens: int,
        want_logprobs: bool,
    ) -> AsyncIterator[str]:
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return to_json(
                ChatCompletionChunk(
                    id=response_id,
                    created=created,
                    model=self.config.model,
                    choices=choices,
                    usage=usage,
                )
            )

        for index in range(body.n):
            yield chunk(
                [ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))]
            )
        completion_tokens = 0
        async for event in run.stream(body.n):
            if event.error is not None:
                yield to_json(_report_error(event.error)[1])
                return
            logprobs = self._chat_logprobs([event]) if want_logprobs and event.token_ids else None
            if event.finish_reason is not None:
                completion_tokens += event.completion_tokens
                calls = [
                    DeltaToolCall(index=i, **call.model_dump())
                    for i, call in enumerate(event.tool_calls)
                ]
                delta = ChatDelta(content=event.text or None, tool_calls=calls or None)
            elif event.text or logprobs:
                delta = ChatDelta(content=event.text)
            else:
                continue
            yield chunk(
                [
                    ChatChunkChoice(
                        index=event.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=event.finish_reason,
                    )
                ]
            )
        if body.include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens))

    async def _completion_stream(
        self,
        run: "_Run",
        response_id: str,
        body: CompletionRequest,
        prompt_tokens: int,
        want_logprobs: bool,
    ) -> AsyncIterator[str]:
        created = now()
        offsets = [0] * body.n
        completion_tokens = 0
        async for event in run.stream(body.n):
            if event.error is not None:
                yield to_json(_report_error(event.error)[1])
                return
            if not (event.text or event.token_ids or event.finish_reason):
                continue
            logprobs = None
            if want_logprobs and event.token_ids:
                logprobs = self._completion_logprobs([event], offsets[event.index])
            offsets[event.index] += len(event.text)
            completion_tokens += event.completion_tokens
            choice = CompletionChoice(
                index=event.index,
                text=event.text,
                logprobs=logprobs,
                finish_reason=event.finish_reason,
            )
            yield to_json(
                Completion(
                    id=response_id, created=created, model=self.config.model, choices=[choice]
                )
            )
        if body.include_usage:
            usage = _usage(prompt_tokens, completion_tokens)
            yield to_json(
                Completion(
                    id=response_id,
                    created=created,
                    model=self.config.model,
                    choices=[],
                    usage=usage,
                )
            )

    # -- logprobs -------------------------------------------------------------------------

    def _chat_logprobs(self, events: list[_Event]) -> ChoiceLogprobs:
        content = []
        for event in events:
            for token_id, logprob in zip(event.token_ids, event.logprobs, strict=True):
                token = self.tokenizer.decode([token_id])
                content.append(
                    TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
                )
        return ChoiceLogprobs(content=content)

    def _completion_logprobs(self, events: list[_Event], offset: int) -> CompletionLogprobs:
        tokens, logprobs, offsets = [], [], []
        for event in events:
            for token_id, logprob in zip(event.token_ids, event.logprobs, strict=True):
                token = self.tokenizer.decode([token_id])
                tokens.append(token)
                logprobs.append(logprob)
                offsets.append(offset)
                offset += len(self.tokenizer.decode([token_id], skip_special_tokens=True))
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets)


@dataclass
class _Run:
    """The choice tasks of one request and the events they put."""

    events: asyncio.Queue[_Event]
    tasks: list[asyncio.Task] = field(default_factory=list)
    started: list[asyncio.Future[None]] = field(default_factory=list)

    async def stream(self, n: int) -> AsyncIterator[_Event]:
        """Events as they come, until every choice has put its last one. Leaving early
        cancels the choices that still run."""
        remaining = n
        try:
            while remaining:
                event = await self.events.get()
                if event.finish_reason is not None or event.error is not None:
                    remaining -= 1
                yield event
        finally:
            self.cancel()

    def cancel(self) -> None:
        # Not awaited: a cancelled request may not wait; each task closes its own call.
        for task in self.tasks:
            task.cancel()


async def _collect(run: _Run, n: int) -> list[list[_Event]]:
    """Every choice's events, in order; raises the first error."""
    per_choice: list[list[_Event]] = [[] for _ in range(n)]
    async for event in run.stream(n):
        if event.error is not None:
            raise event.error
        per_choice[event.index].append(event)
    return per_choice


def _joined_text(events: list[_Event]) -> str:
    return "".join(event.text for event in events)


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


# -- HTTP plumbing --------------------------------------------------------------------------


def _parse(schema: type[R], body: bytes) -> R:
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(
            str(p) for p in first["loc"] if not (isinstance(p, str) and _UNION_TAG.search(p))
        )
        if first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif first["type"] == "json_invalid":
            message = f"The request body is not valid JSON: {first['msg']}"
        else:
            message = describe(exc)
        raise InvalidRequestError(message, param=param or None) from exc


def _session_id(request: Request, user: str | None) -> str:
    header = request.headers.get(SESSION_HEADER)
    if header is not None:
        value, param = header, SESSION_HEADER
    elif user is not None:
        value, param = user, "user"
    else:
        return uuid.uuid4().hex
    if not _SESSION_ID.fullmatch(value):
        raise InvalidRequestError(
            f"session id {value!r} (from {param}) is not allowed: use 1-64 letters, digits, "
            "'_' or '-'",
            param=param,
        )
    return value


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ``ClientDisconnectedError`` (and ``work`` cancelled) as soon as
    the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnectedError("the client disconnected before the response was ready")
    return task.result()


def _json(model: BaseModel) -> Response:
    return Response(to_json(model), media_type="application/json")


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for data in events:
                yield f"data: {data}\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            ERRORS.labels("client_disconnected").inc()
            log.info(kv("gateway_stream_abandoned"))
            raise
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


_ERROR_KINDS: list[tuple[type[Exception], int, str, str]] = [
    # (exception, HTTP status, OpenAI error type, metric label)
    (ContextLengthError, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (ClientDisconnectedError, 499, "client_disconnected", "client_disconnected"),
    (RecordUnavailableError, 503, "service_unavailable", "record_failed"),
    (GenerationUnavailableError, 503, "service_unavailable", "unavailable"),
    (GenerationFailedError, 500, "server_error", "generation_failed"),
]


def _report_error(exc: Exception) -> tuple[int, ErrorBody]:
    """Count and log ``exc``; return its HTTP status and OpenAI-style body."""
    known = next(((s, t, m) for kind, s, t, m in _ERROR_KINDS if isinstance(exc, kind)), None)
    if known is None:
        known = (500, "internal_error", "internal")
        log.error(kv("gateway_internal_error", error=f"{type(exc).__name__}: {exc}"), exc_info=exc)
    status, error_type, label = known
    param = getattr(exc, "param", None)
    code = getattr(exc, "code", None)
    ERRORS.labels(label).inc()
    log.warning(kv("gateway_error", type=label, status=status, param=param, error=str(exc)))
    detail = ErrorDetail(message=str(exc), type=error_type, param=param, code=code)
    return status, ErrorBody(error=detail)


def _endpoint(name: str, handler: Callable[[Request], Awaitable[Response]]):
    async def endpoint(request: Request) -> Response:
        try:
            response = await handler(request)
        except Exception as exc:
            status, body = _report_error(exc)
            response = Response(
                body.model_dump_json(), status_code=status, media_type="application/json"
            )
        REQUESTS.labels(name, str(response.status_code)).inc()
        return response

    return endpoint


def build_app(service: OpenAIService) -> Starlette:
    # The gateway serves its own metrics and its calls', on its own HTTP port.
    served = process_registry(REGISTRY, CALL_METRICS)

    async def _metrics(request: Request) -> Response:
        return Response(generate_latest(served), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route(
                "/v1/chat/completions",
                _endpoint("chat_completions", service.chat_completions),
                methods=["POST"],
            ),
            Route(
                "/v1/completions", _endpoint("completions", service.completions), methods=["POST"]
            ),
            Route("/v1/models", _endpoint("models", service.models), methods=["GET"]),
            Route("/health", service.health, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
        ]
    )


# -- the process ----------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the caller's ``stop`` event ends the gateway."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def default_stop_token_ids(model_path: Path, tokenizer: Any) -> list[int]:
    """The model's eos ids: the tokenizer's, config.json's and generation_config.json's."""
    extra = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    return sorted(eos_token_ids(model_path) | extra)


class Gateway:
    """A running gateway (NATS connection, tokenizer, HTTP server), as ``async with``."""

    def __init__(self, config: GatewayConfig, nats_url: str) -> None:
        self.config = config
        self.nats_url = nats_url
        self.service: OpenAIService | None = None
        self._server: _Server | None = None
        self._serving: asyncio.Task | None = None
        self._socket: socket.socket | None = None

    @property
    def port(self) -> int:
        assert self._socket is not None, "the gateway is not started"
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        """The base URL clients use (``.../v1``)."""
        return f"http://{self.config.host}:{self.port}/v1"

    async def __aenter__(self) -> "Gateway":
        config = self.config
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model_path)
        max_model_len = config.max_model_len or model_info(config.model_path).get(
            "max_position_embeddings"
        )
        if not max_model_len:
            raise ModelError(
                f"{config.model_path}/config.json has no max_position_embeddings: set max_model_len"
            )
        stop_ids = config.stop_token_ids
        if stop_ids is None:
            stop_ids = default_stop_token_ids(config.model_path, tokenizer)
        nc = await connect(self.nats_url, "seamlessflow-gateway")
        try:
            js = nc.jetstream(timeout=config.nats_timeout_s)
            await _check_provisioned(js, RunNames(config.run))
            self.service = OpenAIService(config, tokenizer, nc, js, max_model_len, stop_ids)
            self._socket = _listen(config.host, config.port)
            self._server = _Server(
                uvicorn.Config(
                    build_app(self.service),
                    log_level="warning",
                    lifespan="off",
                    timeout_graceful_shutdown=5,
                )
            )
            self._serving = asyncio.create_task(self._server.serve(sockets=[self._socket]))
            while not self._server.started:
                if self._serving.done():
                    self._serving.result()
                    raise RolloutError("the HTTP server stopped while starting")
                await asyncio.sleep(0.01)
        except BaseException:
            try:
                await self._stop_server()
            finally:
                await disconnect(nc)
            raise
        log.info(kv("gateway_started", url=self.url, model=config.model, run=config.run))
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self._stop_server()
        finally:
            if self.service is not None:
                await self.service.close()
                await disconnect(self.service.nc)
        log.info(kv("gateway_stopped", model=self.config.model, run=self.config.run))

    async def _stop_server(self) -> None:
        try:
            if self._server is not None and self._serving is not None:
                self._server.should_exit = True
                await self._serving
        finally:
            if self._socket is not None:
                self._socket.close()


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise RolloutError(f"the gateway cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise RolloutError(f"the gateway cannot listen on {host}:{port}: {exc}") from exc
    return sock


async def _check_provisioned(js: JetStreamContext, names: RunNames) -> None:
    for stream in (names.gen_stream, names.traj_stream):
        try:
            await js.stream_info(stream)
        except NotFoundError as exc:
            raise GenerationUnavailableError(
                f"run {names.run!r} is not provisioned: stream {stream} is missing "
                f"(run `seamlessflow provision --run {names.run}`)"
            ) from exc
        except (NatsError, OSError) as exc:
            raise GenerationUnavailableError(
                f"cannot check run {names.run!r} on NATS: {type(exc).__name__}: {exc}"
            ) from exc


async def serve_gateway(config: GatewayConfig, nats_url: str, stop: asyncio.Event) -> None:
    """Serve the gateway until ``stop`` is set."""
    async with Gateway(config, nats_url) as gateway:
        print(
            f"gateway ready: url={gateway.url} model={config.model} run={config.run} "
            f"metrics=http://{config.host}:{gateway.port}/metrics",
            flush=True,
        )
        await stop.wait()
