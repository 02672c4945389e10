"""Session and group ids of a task's attempts, the headers of their calls, and the gateway's base
URL."""

import hashlib

import httpx

from broker.subjects import SESSION_HEADER, TASK_HEADER


def session_id(task_id: str, attempt: int, delivery: int = 1, retry: int = 0) -> str:
    """The session of attempt ``attempt`` at a task: ``<task_id>-<attempt>``, with ``-d<n>`` for
    the ``n``-th delivery of the task and ``-r<k>`` for its ``k``-th run after an outage on one
    delivery (a retried task starts fresh sessions). A task id too long to fit the 64-character
    id is cut and completed with its hash."""
    return _suffixed(task_id, f"-{attempt}{_retried(delivery, retry)}")


def group_id(task_id: str, delivery: int = 1, retry: int = 0) -> str:
    """The group of a task's attempts: the task id, with ``-d<n>``/``-r<k>`` once it is retried
    (so a retried task's fresh sessions never join the sessions of an earlier run)."""
    suffix = _retried(delivery, retry)
    return _suffixed(task_id, suffix) if suffix else task_id


def _retried(delivery: int, retry: int) -> str:
    return (f"-d{delivery}" if delivery > 1 else "") + (f"-r{retry}" if retry > 0 else "")


def _suffixed(task_id: str, suffix: str) -> str:
    if len(task_id) + len(suffix) <= 64:
        return task_id + suffix
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:24]
    return f"{task_id[: 64 - len(suffix) - 25]}-{digest}{suffix}"


def gateway_headers(session_id: str, task_id: str) -> dict[str, str]:
    """What an attempt sends the gateway with every call: its session, and its admitted task
    (without it the gateway counts the call as direct)."""
    return {SESSION_HEADER: session_id, TASK_HEADER: task_id}


def gateway_base(url: str) -> str:
    """The gateway's OpenAI base URL (``.../v1``), given it with or without ``/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def same_origin(url: object, gateway_url: str) -> bool:
    """Whether ``url`` (a string, or any client library's URL: the OpenAI SDK's is not httpx's)
    is on the gateway's scheme, host and port: a call an agent made to the gateway, not to
    another service."""
    a, b = httpx.URL(str(url)), httpx.URL(gateway_url)
    return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)
