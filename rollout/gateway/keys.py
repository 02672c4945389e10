"""The gateway's bearer keys: the keys file, checking a presented key, and the session tenants.

A keys file is TOML, readable by its owner only (mode 0600 or stricter; any other is refused),
one ``[[key]]`` table per key::

    [[key]]
    key = "sfk-..."          # the bearer secret: 16 characters or more
    scope = "openai"         # "openai": the /v1 routes; "metrics": GET /metrics
    tenant = "team-a"        # optional, openai keys only: calls for this tenant's sessions only
    name = "agents"          # optional: names the key in logs (the key itself never is)

A client sends ``Authorization: Bearer <key>`` (the OpenAI SDKs' ``api_key``). ``check`` hashes
the presented key and compares its digest with every key's in constant time, all of them each
time, so neither the answer's time nor its path tells which key came close. A *key file* (one
key alone, as Prometheus' ``credentials_file`` reads it) gives a client its key:
``read_key_file``; ``write_run_keys`` makes a fresh keys file and the key files of a run's
clients, every file created 0600.

``SessionTenants`` remembers which tenant each session started under (bounded, least recently
used first forgotten): a tenant-bound key calls only for its tenant's sessions.
"""

import hashlib
import hmac
import ipaddress
import secrets
import stat
import tomllib
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from common.paths import write_private
from rollout.exceptions import RolloutError

KEY_MIN_CHARS = 16
KEY_SCOPE = "sf_gateway_key"
"""Where the key check (``rollout.gateway.app.KeyCheck``) leaves a request's ``Key`` in its ASGI
scope, for the handlers."""
_UNTENANTED = ""
"""The owner recorded for a session started under a key without a tenant (the run's own)."""


class KeysError(RolloutError):
    """A keys file (or key file) that cannot be used, or a gateway that must not start open."""


class Scope(StrEnum):
    OPENAI = "openai"
    METRICS = "metrics"


@dataclass(frozen=True)
class Key:
    """One key as loaded: its digest (never the key), scope, tenant and name."""

    digest: bytes
    scope: Scope
    tenant: str | None = None
    name: str = ""


class Keys:
    """The keys a gateway accepts."""

    def __init__(self, keys: list[Key], source: str = "") -> None:
        if not keys:
            raise KeysError(f"{source or 'keys'}: no keys")
        self.keys = keys
        self.source = source

    def check(self, presented: str) -> Key | None:
        """The key ``presented`` is, or None. Every key's digest is compared, in constant time."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _check_private(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeysError(f"cannot read the gateway keys file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(
            f"the keys file {path} is readable by others (mode {stat.S_IMODE(mode):04o}): "
            f"make it 0600 (chmod 600 {path})"
        )


def load_keys(path: Path) -> Keys:
    """The keys of the keys file ``path`` (see the module docstring); ``KeysError`` naming the
    file when it is not private, not TOML, or a key is malformed."""
    _check_private(path)
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KeysError(f"cannot read the gateway keys file {path}: {exc}") from exc
    entries = table.get("key", [])
    if set(table) - {"key"} or not isinstance(entries, list):
        raise KeysError(f"{path}: expected [[key]] tables only")
    keys, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{path}: key {i + 1}"
        if not isinstance(entry, dict) or set(entry) - {"key", "scope", "tenant", "name"}:
            raise KeysError(f"{where}: only key, scope, tenant and name are allowed")
        secret, scope, tenant, name = (entry.get(f) for f in ("key", "scope", "tenant", "name"))
        if not isinstance(secret, str) or len(secret) < KEY_MIN_CHARS:
            raise KeysError(f"{where}: 'key' must be a string of {KEY_MIN_CHARS}+ characters")
        if scope not in set(Scope):
            raise KeysError(f"{where}: 'scope' must be one of {', '.join(Scope)}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise KeysError(f"{where}: 'tenant' must be a non-empty string")
        if tenant is not None and scope != Scope.OPENAI:
            raise KeysError(f"{where}: only openai keys have a tenant")
        if name is not None and not isinstance(name, str):
            raise KeysError(f"{where}: 'name' must be a string")
        if secret in seen:
            raise KeysError(f"{where}: the same key twice")
        seen.add(secret)
        keys.append(Key(digest(secret), Scope(scope), tenant, name or f"key-{i + 1}"))
    return Keys(keys, str(path))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def gateway_keys(keys_file: Path | None, host: str) -> Keys | None:
    """The keys a gateway on ``host`` checks; None (open) only on a loopback host."""
    if keys_file is None:
        if not is_loopback(host):
            raise KeysError(
                f"the gateway will not listen on {host!r} without keys: set [gateway] keys_file "
                "(--keys-file), or listen on 127.0.0.1"
            )
        return None
    return load_keys(keys_file)


def new_key() -> str:
    return "sfk-" + secrets.token_urlsafe(32)


def read_key_file(path: Path) -> str:
    """The key in the key file ``path`` (the key alone, surrounding whitespace ignored)."""
    _check_private(path)
    try:
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysError(f"cannot read the key file {path}: {exc}") from exc
    if len(key) < KEY_MIN_CHARS:
        raise KeysError(f"the key file {path} holds no key of {KEY_MIN_CHARS}+ characters")
    return key


@dataclass(frozen=True)
class RunKeys:
    keys_file: Path
    """The gateway's keys file."""
    openai_key_file: Path
    """The agent runner's key (scope openai, no tenant)."""
    metrics_key_file: Path
    """The /metrics key: a Prometheus ``credentials_file``."""


def write_run_keys(folder: Path) -> RunKeys:
    """A fresh keys file ``gateway_keys.toml`` in ``folder`` with one openai key (the agent
    runner's, ``agents.key``) and one metrics key (``metrics.key``), all 0600."""
    openai_key, metrics_key = new_key(), new_key()
    run = RunKeys(folder / "gateway_keys.toml", folder / "agents.key", folder / "metrics.key")
    write_private(
        run.keys_file,
        "# The gateway's keys (rollout/gateway/keys.py), made by `seamlessflow run`.\n"
        f'[[key]]\nkey = "{openai_key}"\nscope = "openai"\nname = "agents"\n\n'
        f'[[key]]\nkey = "{metrics_key}"\nscope = "metrics"\nname = "metrics"\n',
    )
    write_private(run.openai_key_file, openai_key + "\n")
    write_private(run.metrics_key_file, metrics_key + "\n")
    return run


class SessionTenants:
    """Which tenant each session started under, for the last ``max_sessions`` sessions used."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._owners: OrderedDict[str, str] = OrderedDict()

    def allows(self, session_id: str, key: Key) -> bool:
        """Whether ``key`` may call for ``session_id``; the first call's key claims it. A key
        without a tenant (the run's own) calls for any session; a tenant's key only for the
        sessions its tenant started."""
        tenant = key.tenant if key.tenant is not None else _UNTENANTED
        owner = self._owners.get(session_id)
        if owner is None:
            self._owners[session_id] = tenant
            if len(self._owners) > self.max_sessions:
                self._owners.popitem(last=False)
            return True
        self._owners.move_to_end(session_id)
        return key.tenant is None or owner == tenant
