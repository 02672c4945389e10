"""The OpenAI-compatible gateway: HTTP for agents, token ids to rollout workers over NATS.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not, ``n`` choices),
``GET /v1/models``, ``GET /metrics``, ``GET /health``. Modules:

- ``config``: ``GatewayConfig``;
- ``service``: the one request path both endpoints share (validate, build the prompt ids on the
  session's earlier turns, run a call per choice, answer, remember the turn);
- ``formats``: what differs per endpoint (prompt source, echo of the output, response and stream
  shapes);
- ``choices``: one request's choices as they run (events, the run of tasks);
- ``responses``: JSON, SSE and OpenAI-style error bodies;
- ``app``: the HTTP routes and ``/metrics``; ``metrics``: the gateway's metric registry;
- ``server``: ``Gateway`` (the process, as ``async with``) and ``serve_gateway``;
- ``calls``: one LLM call over NATS per the generation protocol, and its metric registry.

Its pure cores: ``openai_api`` (request/response models), ``tools`` (tools in the prompt,
``tool_choice``, tool calls out of the output; templates in ``templates/``), ``prompts``
(templates, per-session token reuse), ``detok`` (incremental detokenization with stop strings).
"""

from rollout.gateway.app import build_app
from rollout.gateway.config import GatewayConfig
from rollout.gateway.metrics import REGISTRY
from rollout.gateway.server import Gateway, default_stop_token_ids, serve_gateway
from rollout.gateway.service import OpenAIService

__all__ = [
    "REGISTRY",
    "Gateway",
    "GatewayConfig",
    "OpenAIService",
    "build_app",
    "default_stop_token_ids",
    "serve_gateway",
]
