"""The gateway's bearer keys (``rollout.gateway.keys``, ``rollout.gateway.app.KeyCheck``): a real
gateway with a keys file in front of a real rollout worker on a real nats-server, called through
the official ``openai`` SDK (and plain HTTP for what the SDK does not send: an empty key)."""

import asyncio
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from starlette.routing import Route

from broker.subjects import SESSION_HEADER
from common.paths import write_private
from rollout.gateway import Gateway
from rollout.gateway.app import OPEN_PATHS, KeyCheck
from rollout.gateway.keys import (
    Key,
    KeysError,
    Scope,
    SessionTenants,
    digest,
    gateway_keys,
    is_loopback,
    load_keys,
    read_key_file,
    write_run_keys,
)
from tests.support import MODEL, GatewayThread, RunPool, Stack, gateway_config

pytestmark = pytest.mark.newest_nats

RUN_KEY = "sfk-run-0123456789abcdef"
TENANT_A = "sfk-tenant-a-0123456789"
TENANT_B = "sfk-tenant-b-0123456789"
METRICS_KEY = "sfk-metrics-0123456789ab"
KEYS = f"""
[[key]]
key = "{RUN_KEY}"
scope = "openai"
name = "agents"

[[key]]
key = "{TENANT_A}"
scope = "openai"
tenant = "a"

[[key]]
key = "{TENANT_B}"
scope = "openai"
tenant = "b"
name = "tenant-b"

[[key]]
key = "{METRICS_KEY}"
scope = "metrics"
"""
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "gateway_keys.toml"
    write_private(path, KEYS)
    return path


@pytest.fixture(scope="module")
def gw(stack: Stack, runs: RunPool, tiny_model_dir: Path, keys_file: Path) -> Iterator:
    """A gateway with keys on the stack's run (the stack's worker serves its calls)."""
    config = gateway_config(tiny_model_dir, stack.names.run, keys_file=keys_file)
    with ExitStack() as started:
        with runs.joined(stack.names.run):
            gateway = started.enter_context(GatewayThread(config, runs.broker.url))
        yield gateway


def client(gw, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0, default_headers=headers)


def root(gw) -> str:
    return gw.url.removesuffix("/v1")


def scrape_with(gw, key: str) -> float:
    async def read() -> float:
        async with httpx.AsyncClient() as http:
            answer = await http.get(
                f"{root(gw)}/metrics", headers={"Authorization": f"Bearer {key}"}
            )
        answer.raise_for_status()
        total = 0.0
        for line in answer.text.splitlines():
            if line.startswith("sf_gateway_auth_refused_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    return asyncio.run(read())


def test_no_empty_or_wrong_key_is_401_and_counted(gw) -> None:
    before = scrape_with(gw, METRICS_KEY)
    no_key = {"Authorization": openai.Omit()}  # the SDK sends no Authorization header
    for key, headers in (("unset", no_key), ("sfk-wrong-0123456789abc", None)):
        with pytest.raises(openai.AuthenticationError) as caught:
            client(gw, key).chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=2, extra_headers=headers
            )
        assert caught.value.status_code == 401
        assert caught.value.response.headers["www-authenticate"] == "Bearer"
        assert caught.value.code == "invalid_api_key"
    for header in ("", "Bearer", "Basic " + RUN_KEY, RUN_KEY):  # empty, or no bearer key
        answer = httpx.get(f"{gw.url}/models", headers={"Authorization": header})
        assert answer.status_code == 401, header
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert scrape_with(gw, METRICS_KEY) - before == 6


def test_right_key_completes(gw) -> None:
    reply = client(gw, RUN_KEY).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens >= 1
    models = client(gw, TENANT_A).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_another_tenants_key_on_a_session_is_403(gw) -> None:
    session = {SESSION_HEADER: "keys-tenant-a-session"}
    a, b = client(gw, TENANT_A, **session), client(gw, TENANT_B, **session)
    a.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)  # claims the session
    before = scrape_with(gw, METRICS_KEY)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        b.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert caught.value.status_code == 403
    with pytest.raises(openai.PermissionDeniedError):  # the session named by ``user`` as well
        client(gw, TENANT_B).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, user="keys-tenant-a-session"
        )
    assert scrape_with(gw, METRICS_KEY) - before == 2
    a.completions.create(model=MODEL, prompt="Hi", max_tokens=2)  # its own still works
    client(gw, RUN_KEY, **session).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    # a session the run's own key started is no tenant's to take
    run_session = {SESSION_HEADER: "keys-run-session"}
    client(gw, RUN_KEY, **run_session).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.PermissionDeniedError):
        client(gw, TENANT_A, **run_session).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2
        )


def test_metrics_take_the_metrics_key_only(gw) -> None:
    url = f"{root(gw)}/metrics"
    assert httpx.get(url).status_code == 401
    as_openai = httpx.get(url, headers={"Authorization": f"Bearer {RUN_KEY}"})
    assert as_openai.status_code == 403
    assert as_openai.json()["error"]["code"] == "permission_denied"
    assert httpx.get(url, headers={"Authorization": f"Bearer {METRICS_KEY}"}).status_code == 200
    with pytest.raises(openai.PermissionDeniedError):  # and the metrics key no OpenAI route
        client(gw, METRICS_KEY).models.list()


def test_health_is_open(gw) -> None:
    assert httpx.get(f"{root(gw)}/health").status_code == 200


def test_every_other_route_refuses_no_key(gw) -> None:
    assert isinstance(gw.app, KeyCheck)
    routes = [r for r in gw.app.app.routes if isinstance(r, Route)]
    assert len(routes) == len(gw.app.app.routes)  # no mount or websocket route unlisted here
    checked = 0
    for route in routes:
        if route.path in OPEN_PATHS:
            continue
        for method in route.methods - {"HEAD"}:
            answer = httpx.request(method, root(gw) + route.path, json={})
            assert answer.status_code == 401, (method, route.path)
            checked += 1
    assert checked >= 4
    assert httpx.get(f"{root(gw)}/no/such/route").status_code == 401  # not even a 404


def test_non_loopback_host_without_keys_does_not_start(tiny_model_dir: Path) -> None:
    config = gateway_config(tiny_model_dir, "nokeys", host="0.0.0.0")

    async def start() -> None:
        async with Gateway(config, "nats://127.0.0.1:1"):
            pass

    with pytest.raises(KeysError, match=r"will not listen on '0.0.0.0' without keys"):
        asyncio.run(start())


def test_loopback_hosts() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.org", ""]))
    assert gateway_keys(None, "127.0.0.1") is None


def test_keys_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    os.chmod(path, 0o644)
    with pytest.raises(KeysError, match=f"{path}.*readable by others.*0644"):
        load_keys(path)
    with pytest.raises(KeysError, match=str(path)):
        gateway_keys(path, "0.0.0.0")
    os.chmod(path, 0o600)
    assert len(load_keys(path).keys) == 4


@pytest.mark.parametrize(
    "text, error",
    [
        ('[[key]]\nkey = "short"\nscope = "openai"\n', "16"),
        ('[[key]]\nkey = "0123456789abcdefg"\nscope = "admin"\n', "scope"),
        ('[[key]]\nkey = "0123456789abcdefg"\nscope = "metrics"\ntenant = "a"\n', "tenant"),
        ('[[key]]\nkey = "0123456789abcdefg"\nscope = "openai"\nextra = 1\n', "allowed"),
        ('key = "0123456789abcdefg"\n', r"\[\[key\]\]"),
        ("[[key]\n", "cannot read"),
        ("", "no keys"),
    ],
)
def test_malformed_keys_files(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "keys.toml"
    write_private(path, text)
    with pytest.raises(KeysError, match=error):
        load_keys(path)


def test_run_keys_are_private_and_match(tmp_path: Path) -> None:
    run = write_run_keys(tmp_path / "run")
    keys = load_keys(run.keys_file)
    for path in (run.keys_file, run.openai_key_file, run.metrics_key_file):
        assert path.stat().st_mode & 0o777 == 0o600
    assert keys.check(read_key_file(run.openai_key_file)).scope is Scope.OPENAI
    assert keys.check(read_key_file(run.metrics_key_file)).scope is Scope.METRICS
    assert keys.check("") is None and keys.check(read_key_file(run.openai_key_file) + "x") is None
    first = read_key_file(run.openai_key_file)
    again = write_run_keys(tmp_path / "run")  # a new run: new keys
    assert read_key_file(again.openai_key_file) != first


def test_session_tenants_are_bounded() -> None:
    a, b = Key(digest("a" * 16), Scope.OPENAI, "a"), Key(digest("b" * 16), Scope.OPENAI, "b")
    tenants = SessionTenants(2)
    assert tenants.allows("s1", a) and not tenants.allows("s1", b)
    tenants.allows("s2", a)
    tenants.allows("s3", a)  # s1 forgotten, least recently used
    assert len(tenants._owners) == 2
    assert tenants.allows("s1", b)
