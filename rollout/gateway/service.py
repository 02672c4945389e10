"""The request path, one for both endpoints (``rollout.gateway.formats`` supplies what differs):

1. validate the request (``rollout.gateway.openai_api``) and find its session: header
   ``X-Session-Id``, else the ``user`` field, else a fresh id;
2. build the prompt ids: render the chat template (or take the client's text or ids) and reuse
   the ids of the session's earlier turns (``rollout.gateway.prompts``);
3. run one ``rollout.gateway.calls.Call`` per choice, each in its own task, detokenizing its
   tokens (``rollout.gateway.detok``) with stop strings and tool-call parsing;
4. answer (JSON, or SSE as the tokens arrive) and remember each finished turn for the session,
   as the client will echo it.

Templates, tokenization and the session store run on one tokenizer thread, never on the event
loop (a fresh 17k-token prompt took 35 ms there, stalling every stream): one thread, so the
store needs no lock and a tokenizer is never used by two threads at once for encoding.
"""

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker import codec
from broker.client import round_trip
from broker.codec import describe
from broker.messages import CallUnavailable, FinishReason, SamplingParams, ToolCall
from broker.subjects import NAME_PATTERN, SESSION_HEADER, TASK_HEADER, RunNames
from common.log import kv
from rollout.exceptions import (
    ClientDisconnectedError,
    ContextLengthError,
    GenerationFailedError,
    GenerationUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    PermissionDeniedError,
    RecordUnavailableError,
    RolloutError,
)
from rollout.gateway.calls import Call
from rollout.gateway.choices import ChoiceSpec, Event, Run
from rollout.gateway.config import GatewayConfig
from rollout.gateway.detok import Detokenizer
from rollout.gateway.formats import ChatFormat, CompletionFormat, Format, usage
from rollout.gateway.keys import KEY_SCOPE, Key, SessionTenants
from rollout.gateway.metrics import AUTH_REFUSED, CALLS, PROMPT_TOKENS, TOKENS_OUT
from rollout.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now,
    to_json,
)
from rollout.gateway.prompts import Prompt, SessionStore
from rollout.gateway.responses import json_response, report_error, sse
from rollout.gateway.tools import ToolCallStream, ToolSupport

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(NAME_PATTERN)
_CONTEXT_IDS = 5
"""Prompt ids the detokenizer sees before the output (word-start markers need them)."""
_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|list|dict|none)$")

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)


class OpenAIService:
    """The request handlers; ``rollout.gateway.app.build_app`` routes HTTP to them."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Any,
        tools: ToolSupport,
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
        self.end_markers = {tokenizer.decode([i]): i for i in stop_token_ids}
        """How each stop token reads in rendered text (a chat turn's end)."""
        self.sessions = SessionStore(config.session_cache_sessions, config.session_cache_tokens)
        self.tenants = SessionTenants(config.session_cache_sessions)
        """Which tenant each session started under (with keys: ``rollout.gateway.keys``)."""
        self.tool_support = tools
        if not (tools.template or tools.model_renders_tools):
            log.warning(kv("gateway_tools_not_rendered", model=config.model_path))
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenizer")
        self._tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        """Cancel the calls still running (each is cancelled on its worker and recorded)."""
        for task in self._tasks:
            if not task.cancelling():  # a second cancel would cut short its record's publish
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # -- endpoints ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = _parse(ChatCompletionRequest, await request.body())
        format_ = ChatFormat(
            body, self.config.model, self.tokenizer, self.end_markers, self.tool_support
        )
        return await self._respond(request, format_)

    async def completions(self, request: Request) -> Response:
        body = _parse(CompletionRequest, await request.body())
        return await self._respond(
            request, CompletionFormat(body, self.config.model, self.tokenizer)
        )

    async def models(self, request: Request) -> Response:
        card = ModelCard(id=self.config.model, created=now(), max_model_len=self.max_model_len)
        return json_response(ModelList(data=[card]))

    async def health(self, request: Request) -> Response:
        connected = self.nc.is_connected
        return JSONResponse(
            {"status": "ok" if connected else "unavailable", "nats_connected": connected},
            status_code=200 if connected else 503,
        )

    # -- request steps --------------------------------------------------------------------

    async def _respond(self, request: Request, format_: Format) -> Response:
        body = format_.body
        if body.model != self.config.model:
            raise ModelNotFoundError(
                f"the model {body.model!r} does not exist; this gateway serves "
                f"{self.config.model!r}"
            )
        session_id = _session_id(request, body.user)
        if SESSION_HEADER in request.headers or body.user is not None:  # not a fresh one
            self._check_tenant(request, session_id)
        prompt = await self._prompt(session_id, format_)
        max_tokens = self._max_tokens(
            len(prompt.ids), format_.requested_max_tokens, format_.prompt_param
        )
        specs = self._specs(format_, max_tokens)
        CALLS.labels("task" if TASK_HEADER in request.headers else "direct").inc(len(specs))
        run = await self._start(request, session_id, prompt, format_, specs)
        if body.stream:
            return sse(self._stream(run, format_, len(prompt.ids)))
        events = await _unless_disconnected(request, run.collect())
        completion_tokens = sum(parts[-1].completion_tokens for parts in events)
        return json_response(format_.reply(events, usage(len(prompt.ids), completion_tokens)))

    def _check_tenant(self, request: Request, session_id: str) -> None:
        """A tenant's key calls only for its tenant's sessions (the first call claims one)."""
        key: Key | None = request.scope.get(KEY_SCOPE)  # None: the gateway runs without keys
        if key is None or self.tenants.allows(session_id, key):
            return
        AUTH_REFUSED.labels("tenant").inc()
        raise PermissionDeniedError(
            f"session {session_id!r} belongs to another tenant than key {key.name!r}'s"
        )

    async def _off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, function, *args)

    async def _prompt(self, session_id: str, format_: Format) -> Prompt:
        ids = format_.client_ids
        if ids is not None:  # nothing to tokenize: no trip to the tokenizer thread
            PROMPT_TOKENS.labels("client_ids").inc(len(ids))
            return Prompt(ids=ids)
        prompt = await self._off_loop(self._build_prompt, session_id, format_)
        PROMPT_TOKENS.labels("reused").inc(prompt.reused)
        PROMPT_TOKENS.labels("tokenized").inc(len(prompt.ids) - prompt.reused)
        return prompt

    def _build_prompt(self, session_id: str, format_: Format) -> Prompt:
        """(Tokenizer thread.)"""
        return self.sessions.build(session_id, format_.prompt_text(), self._tokenize)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _remember(
        self,
        session_id: str,
        prompt: Prompt,
        format_: Format,
        content: str,
        tool_calls: list[ToolCall],
        output_ids: list[int],
    ) -> None:
        """(Tokenizer thread.) Store the turn as the client will echo it."""
        assert prompt.text is not None
        turn = format_.echo(prompt.text, content, tool_calls, output_ids)
        if turn is None:
            log.info(kv("gateway_echo_unrecognisable", session=session_id))
        after = prompt.text[: len(prompt.text) - len(format_.call_start)]
        self.sessions.record(session_id, prompt, *(turn or ("", [])), after=after)

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

    def _specs(self, format_: Format, max_tokens: int) -> list[ChoiceSpec]:
        body = format_.body
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
            specs.append(ChoiceSpec(index, params))
        return specs

    async def _start(
        self,
        request: Request,
        session_id: str,
        prompt: Prompt,
        format_: Format,
        specs: list[ChoiceSpec],
    ) -> Run:
        """Start a task per choice; return once every call was taken by a worker, so that
        errors up to then are HTTP errors."""
        run = Run(len(specs))
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
                # tokens are read as they come only to stream them or to find a stop string
                streamed=format_.body.stream or bool(format_.body.stop_strings),
            )
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                self._run_choice(spec, call, prompt, format_, run.events, started)
            )
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
        spec: ChoiceSpec,
        call: Call,
        prompt: Prompt,
        format_: Format,
        events: asyncio.Queue[Event],
        started: asyncio.Future[None],
    ) -> None:
        """Run one call to its end, putting its output on ``events``; the last event has the
        finish reason or the error. Remember the turn for the session when it finished."""
        content = ""
        try:
            try:
                await call.start()
            except asyncio.CancelledError:
                started.cancel()
                raise
            except Exception as exc:
                await self._tell_unavailable(call, exc)
                if not started.done():  # (cancelled when the client left: nobody waits)
                    started.set_exception(exc)
                return
            if started.done():  # the client left while the call was being taken: end it
                return
            started.set_result(None)
            try:
                last, content = await self._stream_choice(spec, call, format_, events)
            except RolloutError as exc:
                last = Event(spec.index, error=exc)
            except Exception as exc:  # a bug here must still end the client's stream
                log.exception(kv("gateway_choice_crashed", call=call.call_id))
                last = Event(spec.index, error=GenerationFailedError(f"gateway error: {exc!r}"))
        finally:
            try:
                await call.close()
            except RecordUnavailableError as exc:
                last = Event(spec.index, error=exc)
        try:
            if last.error is not None:
                await self._tell_unavailable(call, last.error)
            # before the client has the last event: its next request may echo this turn
            if last.error is None and prompt.text is not None:
                await self._off_loop(
                    self._remember,
                    call.session_id,
                    prompt,
                    format_,
                    content,
                    last.tool_calls,
                    list(call.output_ids),
                )
        except Exception:  # the turn is not remembered; the client still gets its answer
            log.exception(kv("gateway_session_record_failed", call=call.call_id))
        finally:
            events.put_nowait(last)

    async def _tell_unavailable(self, call: Call, error: BaseException) -> None:
        """A call not served for want of the rollout or the broker (503) is told on its
        session's subject before the client has the answer (``CallUnavailable``): the agent
        runner then tells the outage from its agent's failure whatever client the agent used.
        With the broker gone nothing is told: the runner's ``/health`` check sees that."""
        if not isinstance(error, GenerationUnavailableError | RecordUnavailableError):
            return
        if not self.nc.is_connected:
            return
        notice = CallUnavailable(
            session_id=call.session_id, call_id=call.call_id, reason=str(error)[:1024]
        )
        try:
            await self.nc.publish(self.names.gw_unavailable(call.session_id), codec.encode(notice))
            await round_trip(self.nc)  # the server has it before the client has the 503
        except Exception as exc:
            log.warning(kv("gateway_unavailable_not_told", call=call.call_id, error=exc))

    async def _stream_choice(
        self, spec: ChoiceSpec, call: Call, format_: Format, events: asyncio.Queue[Event]
    ) -> tuple[Event, str]:
        """Put the call's text on ``events`` as it comes; return the final event and the whole
        content the client is given."""
        stop = format_.body.stop_strings
        detok = Detokenizer(self.tokenizer, stop, context=call.prompt_ids[-_CONTEXT_IDS:])
        tools = ToolCallStream(format_.call_start) if format_.plan.parse else None
        content = []
        async with contextlib.aclosing(call.tokens()) as stream:
            async for tokens in stream:
                delta = detok.feed(tokens.ids)
                kept = delta.taken
                if delta.stopped:  # the tokens after the one that completed it are not output
                    call.end(len(call.output_ids) - len(tokens.ids) + kept, "stop string matched")
                TOKENS_OUT.inc(kept)
                text = tools.feed(delta.text) if tools is not None else delta.text
                content.append(text)
                events.put_nowait(
                    Event(spec.index, text, tokens.ids[:kept], tokens.logprobs[:kept])
                )
                if delta.stopped:
                    break
        rest = detok.finish()
        tool_calls: list[ToolCall] = []
        if tools is not None:
            streamed = tools.feed(rest)
            held, tool_calls = tools.finish(format_.plan)
            rest = streamed + held
        content.append(rest)
        if tool_calls:
            finish = "tool_calls"
        else:
            finish = "length" if call.finish_reason is FinishReason.LENGTH else "stop"
        last = Event(
            spec.index,
            rest,
            finish_reason=finish,
            tool_calls=tool_calls,
            completion_tokens=len(call.output_ids),
        )
        return last, "".join(content)

    async def _stream(self, run: Run, format_: Format, prompt_tokens: int) -> AsyncIterator[str]:
        for chunk in format_.opening():
            yield chunk
        completion_tokens = 0
        async for event in run.stream():
            if event.error is not None:
                yield to_json(report_error(event.error)[1])
                return
            completion_tokens += event.completion_tokens
            chunk = format_.chunk(event)
            if chunk is not None:
                yield chunk
        if format_.body.include_usage:
            yield format_.usage_chunk(usage(prompt_tokens, completion_tokens))


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
            # (a cancelled gather ends later, with CancelledError as its exception: taken here,
            # not logged as "never retrieved")
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
    if not task.done() or task.cancelled():
        raise ClientDisconnectedError("the client disconnected before the response was ready")
    return task.result()
