"""The HTTP app: routes to the service's handlers, an error answer for any failure, the request
counter, ``/metrics`` (this process's gateway and call metrics), and the key check in front of
every route but ``/health`` (``KeyCheck``)."""

import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from common.log import kv
from common.metrics import process_registry
from rollout.gateway.calls import REGISTRY as CALL_METRICS
from rollout.gateway.keys import KEY_SCOPE, Keys
from rollout.gateway.keys import Scope as KeyScope
from rollout.gateway.metrics import AUTH_REFUSED, REGISTRY, REQUESTS
from rollout.gateway.openai_api import ErrorBody, ErrorDetail
from rollout.gateway.responses import error_response
from rollout.gateway.service import OpenAIService

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
"""The only paths served without a key."""
_LOG_EVERY_S = 1.0


def _endpoint(name: str, handler: Callable[[Request], Awaitable[Response]]):
    async def endpoint(request: Request) -> Response:
        try:
            response = await handler(request)
        except Exception as exc:
            response = error_response(exc)
        REQUESTS.labels(name, str(response.status_code)).inc()
        return response

    return endpoint


class KeyCheck:
    """ASGI middleware: every request but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``
    with a key of ``keys``: of scope metrics for ``/metrics``, openai for every other path (an
    unknown path too, so a route added later is never open). No or an empty key, or no such
    key: 401 with ``WWW-Authenticate: Bearer``; a key of the other scope: 403. Each refusal is
    counted (``sf_gateway_auth_refused_total{reason}``) and logged on one line (at most one a
    second per reason; the lines skipped are counted in the next); the key is never logged."""

    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app = app
        self.keys = keys
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last line, skipped since)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        need = KeyScope.METRICS if scope["path"] == "/metrics" else KeyScope.OPENAI
        presented = _bearer(scope)
        key = self.keys.check(presented) if presented else None
        if key is None:
            reason, status = ("invalid" if presented else "missing"), 401
        elif key.scope is not need:
            reason, status = "scope", 403
        else:
            scope[KEY_SCOPE] = key
            await self.app(scope, receive, send)
            return
        self._refused(scope, reason, key.name if key else None)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if reason == "missing":
            message = "You didn't provide an API key: send it as 'Authorization: Bearer KEY'."
        elif reason == "invalid":
            message = "Incorrect API key provided."
        else:
            message = f"A {key.scope} key is not allowed on {scope['path']}: it takes a {need} key."
        error = "invalid_request_error" if status == 401 else "permission_error"
        code = "invalid_api_key" if status == 401 else "permission_denied"
        body = ErrorBody(error=ErrorDetail(message=message, type=error, param=None, code=code))
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        response = Response(body.model_dump_json(), status, headers, media_type="application/json")
        await response(scope, receive, send)

    def _refused(self, scope: Scope, reason: str, key_name: str | None) -> None:
        AUTH_REFUSED.labels(reason).inc()
        now = time.monotonic()
        last, skipped = self._logged.get(reason, (-_LOG_EVERY_S, 0))
        if now - last < _LOG_EVERY_S:
            self._logged[reason] = (last, skipped + 1)
            return
        self._logged[reason] = (now, 0)
        client = scope.get("client")
        fields = {"reason": reason, "path": scope["path"], "client": client[0] if client else "-"}
        if key_name is not None:
            fields["key"] = key_name
        if skipped:
            fields["skipped"] = str(skipped)
        log.warning(kv("gateway_auth_refused", **fields))


def _bearer(scope: Scope) -> str:
    """The bearer key of the request's Authorization header ("" if none)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            kind, _, key = value.decode("latin-1").strip().partition(" ")
            return key.strip() if kind.lower() == "bearer" else ""
    return ""


def build_app(service: OpenAIService, keys: Keys | None = None) -> ASGIApp:
    """The gateway's HTTP app; every route but ``/health`` checks ``keys`` when given."""
    app = _routes(service)
    return app if keys is None else KeyCheck(app, keys)


def _routes(service: OpenAIService) -> Starlette:
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
