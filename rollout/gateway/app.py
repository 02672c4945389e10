"""The HTTP app: routes to the service's handlers, an error answer for any failure, the request
counter, and ``/metrics`` (this process's gateway and call metrics)."""

from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.metrics import process_registry
from rollout.gateway.calls import REGISTRY as CALL_METRICS
from rollout.gateway.metrics import REGISTRY, REQUESTS
from rollout.gateway.responses import error_response
from rollout.gateway.service import OpenAIService


def _endpoint(name: str, handler: Callable[[Request], Awaitable[Response]]):
    async def endpoint(request: Request) -> Response:
        try:
            response = await handler(request)
        except Exception as exc:
            response = error_response(exc)
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
