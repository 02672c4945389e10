"""The gateway's own metrics, in its own registry (``common.metrics``); its calls' metrics are
``rollout.gateway.calls.REGISTRY``."""

from prometheus_client import CollectorRegistry, Counter

REGISTRY = CollectorRegistry()

REQUESTS = Counter(
    "sf_gateway_requests",
    "HTTP requests by endpoint and status code",
    ["endpoint", "status"],
    registry=REGISTRY,
)
TOKENS_OUT = Counter("sf_gateway_tokens_out", "Tokens generated for clients", registry=REGISTRY)
CALLS = Counter(
    "sf_gateway_calls",
    "Calls (choices) started, by source: task (an agent runner's attempt at an admitted task, "
    "header X-Task-Id) or direct (a client driving the gateway itself: outside admission's "
    "bound until its session ends)",
    ["source"],
    registry=REGISTRY,
)
for _source in ("task", "direct"):  # exported at 0
    CALLS.labels(_source)
PROMPT_TOKENS = Counter(
    "sf_gateway_prompt_tokens",
    "Prompt tokens by source: reused (ids of a session's earlier turns), tokenized, or "
    "client_ids (sent as ids)",
    ["source"],
    registry=REGISTRY,
)
TOOL_CALLS = Counter(
    "sf_gateway_tool_calls",
    "Tool calls parsed from outputs and returned as OpenAI tool_calls",
    registry=REGISTRY,
)
TOOL_CALLS_MALFORMED = Counter(
    "sf_gateway_tool_calls_malformed",
    "Outputs with tool-call text that did not parse (or named another function than the one "
    "tool_choice asked for): returned as content",
    registry=REGISTRY,
)
AUTH_REFUSED = Counter(
    "sf_gateway_auth_refused",
    "Requests refused by the key check, by reason: missing (no or an empty bearer key), invalid "
    "(no such key: 401), scope (a key for other routes: 403), tenant (a tenant's key on another "
    "tenant's session: 403)",
    ["reason"],
    registry=REGISTRY,
)
for _reason in ("missing", "invalid", "scope", "tenant"):  # exported at 0
    AUTH_REFUSED.labels(_reason)
