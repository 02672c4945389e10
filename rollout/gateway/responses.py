"""HTTP responses: JSON bodies, server-sent events, and OpenAI-style error bodies
``{"error": {"message", "type", "param", "code"}}`` (counted in ``sf_gateway_errors_total`` and
logged)."""

import asyncio
import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

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
)
from rollout.gateway.calls import ERRORS
from rollout.gateway.openai_api import ErrorBody, ErrorDetail, to_json

log = logging.getLogger(__name__)

ERROR_KINDS: list[tuple[type[Exception], int, str, str]] = [
    # (exception, HTTP status, OpenAI error type, metric label)
    (ContextLengthError, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (PermissionDeniedError, 403, "permission_error", "permission_denied"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (ClientDisconnectedError, 499, "client_disconnected", "client_disconnected"),
    # gone before its body arrived (starlette's own): no fault of the gateway's either
    (ClientDisconnect, 499, "client_disconnected", "client_disconnected"),
    (RecordUnavailableError, 503, "service_unavailable", "record_failed"),
    (GenerationUnavailableError, 503, "service_unavailable", "unavailable"),
    (GenerationFailedError, 500, "server_error", "generation_failed"),
]


def report_error(exc: Exception) -> tuple[int, ErrorBody]:
    """Count and log ``exc``; return its HTTP status and OpenAI-style body."""
    known = next(((s, t, m) for kind, s, t, m in ERROR_KINDS if isinstance(exc, kind)), None)
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


def error_response(exc: Exception) -> Response:
    status, body = report_error(exc)
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


def json_response(model: BaseModel) -> Response:
    return Response(to_json(model), media_type="application/json")


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    """``data:`` lines of ``events``, then ``data: [DONE]``."""

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
