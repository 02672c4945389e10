"""Identities: an nkey per principal of a run, in files only their owner reads, and the server
configuration that gives each its rights (``broker.permissions``) in its run's own account.

An identity file (TOML, mode 0600) holds what a client in any language needs to connect::

    run = "quickstart"
    principal = "trainer"
    inbox_prefix = "_INBOX.quickstart.trainer"
    public_key = "UAB..."

and ``seed``, a TOML multi-line string holding the seed (``SUA...``) on a line of its own: so
nats.c and the nats CLI read the same file as a seed file.

The seed signs the server's challenge (nkey authentication, nats-server 2.0+); the server knows
only the public key. Every run is its own NATS account (``account_name``) with its own JetStream
limits, so one run's identities see nothing of another's. ``Authority`` keeps a broker's
identities in one folder (``<folder>/<run>/<principal>.toml``) and renders them as the server's
``accounts`` block; adding a run is a configuration reload (``EmbeddedBroker.reload``).

With mutual TLS mapped to users (``[broker] tls_map``: nats-server's ``verify_and_map``) a
principal is also the user named ``cert_user(run, principal)``: a client certificate with that
email address connects with the principal's rights and no nkey. The authority of a broker that
made its own CA issues one beside each identity file (``<principal>.pem``, named by the file's
``cert``), which ``connect`` presents.
"""

import datetime
import json
import os
import secrets
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import nkeys

from broker.config import AccountLimits
from broker.exceptions import IdentityError
from broker.permissions import Principal, inbox_prefix, rights
from broker.subjects import RunNames, check_name
from broker.tls import ServerFiles, client_certificate
from common.paths import write_private

IDENTITY_ENV = "SEAMLESSFLOW_NATS_IDENTITY"
"""The identity file a process connects with (``broker.client.connect``), whatever its role."""
IDENTITIES_ENV = "SEAMLESSFLOW_NATS_IDENTITIES"
"""A folder of one run's identity files, ``<principal>.toml`` (``seamlessflow creds`` writes
``<broker folder>/auth/<run>/``): each process connects as its own principal's file (a worker
as ``worker.toml``, ``seamlessflow submit`` as ``client.toml``), and ``seamlessflow run --nats
URL`` hands each child its own and connects as the admin. Neither set: anonymous, for a broker
running without authorization (``--insecure``)."""


def account_name(run: str) -> str:
    return f"SF_{check_name('run', run)}"


def cert_user(run: str, principal: Principal) -> str:
    """The email address (SAN) of a client certificate that is ``principal`` of ``run``."""
    return f"{principal.value}@{check_name('run', run)}.seamlessflow"


@dataclass(frozen=True)
class Identity:
    """Who a process is on the broker: its run, principal, inbox prefix and nkey seed, the
    client certificate it presents under mutual TLS, if it has one, and when it expires, if it
    does (the broker leaves it out of its configuration from then on)."""

    run: str
    principal: Principal
    seed: str
    cert: Path | None = None
    expires: datetime.datetime | None = None

    def expired(self, now: datetime.datetime | None = None) -> bool:
        return self.expires is not None and self.expires <= (now or _now())

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.run, self.principal)

    @property
    def public_key(self) -> str:
        return nkeys.from_seed(self.seed.encode()).public_key.decode()

    @classmethod
    def new(
        cls, run: str, principal: Principal, valid_for: datetime.timedelta | None = None
    ) -> "Identity":
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
        expires = (_now() + valid_for).replace(microsecond=0) if valid_for else None
        return cls(check_name("run", run), principal, seed, expires=expires)

    @classmethod
    def load(cls, path: Path) -> "Identity":
        """Read an identity file; refuses one that others may read, or a malformed one."""
        try:
            mode = path.stat().st_mode & 0o777
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise IdentityError(f"cannot read identity file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise IdentityError(f"identity file {path} is not TOML: {exc}") from exc
        if mode & 0o077:
            raise IdentityError(
                f"identity file {path} is readable by others (mode {mode:o}): `chmod 600 {path}`"
            )
        try:
            cert = path.parent / data["cert"] if "cert" in data else None
            expires = data.get("expires")
            if expires is not None and not (
                isinstance(expires, datetime.datetime) and expires.tzinfo is not None
            ):
                raise ValueError(f"expires must be a date-time with its offset, not {expires!r}")
            identity = cls(
                check_name("run", data["run"]),
                Principal(data["principal"]),
                data["seed"].strip(),
                cert,
                expires,
            )
            identity.public_key  # noqa: B018 - the seed must decode
        except (KeyError, ValueError, TypeError, nkeys.ErrInvalidSeed) as exc:
            raise IdentityError(
                f"identity file {path} needs run, principal and a user nkey seed: {exc!r}"
            ) from exc
        return identity

    def save(self, path: Path) -> Path:
        """Write it, mode 0600 from the start (never readable by others, even briefly)."""
        text = (
            f"# SeamlessFlow broker identity: run {self.run}, principal {self.principal}.\n"
            "# Secret: whoever holds this file has these rights. Keep it mode 0600.\n"
            f'run = "{self.run}"\n'
            f'principal = "{self.principal.value}"\n'
            f'inbox_prefix = "{self.inbox_prefix}"\n'
            f'public_key = "{self.public_key}"\n'
            + (f'cert = "{self.cert.name}"  # beside this file\n' if self.cert else "")
            + (f"expires = {self.expires.isoformat()}\n" if self.expires else "")
            + "# on a line of its own: nats.c and the nats CLI read this file as a seed file\n"
            f'seed = """\n{self.seed}\n"""\n'
        )
        return write_private(path, text)

    def connect_options(self) -> dict:
        """nats-py ``connect`` keyword arguments."""
        return {"nkeys_seed_str": self.seed, "inbox_prefix": self.inbox_prefix}


def identity_path(explicit: Path | None, principal: Principal | None) -> Path | None:
    """The identity file a process of ``principal`` connects with: ``explicit``, else
    ``$SEAMLESSFLOW_NATS_IDENTITY``, else its own in ``$SEAMLESSFLOW_NATS_IDENTITIES``; None:
    anonymous."""
    if explicit is not None:
        return explicit
    if os.environ.get(IDENTITY_ENV):
        return Path(os.environ[IDENTITY_ENV])
    if principal is not None and os.environ.get(IDENTITIES_ENV):
        return Path(os.environ[IDENTITIES_ENV]) / f"{principal.value}.toml"
    return None


def run_identities(folder: Path) -> dict[Principal, Path]:
    """Every principal's identity file in ``folder``; ``IdentityError`` naming a missing one."""
    identities = {p: folder / f"{p.value}.toml" for p in Principal}
    if missing := [p.value for p, path in identities.items() if not path.is_file()]:
        raise IdentityError(
            f"{folder} lacks the identities of {', '.join(missing)}: issue them with "
            "`seamlessflow creds --run RUN --state-dir BROKER_FOLDER`"
        )
    return identities


class Authority:
    """A broker's identities, one folder per run, and the accounts they make. With
    ``map_certs`` each principal is also its ``cert_user``; with ``ca`` (a CA this broker
    made) each identity gets its client certificate."""

    def __init__(
        self,
        folder: Path,
        limits: AccountLimits,
        *,
        map_certs: bool = False,
        ca: ServerFiles | None = None,
    ) -> None:
        self.folder = folder
        self.limits = limits
        self.map_certs = map_certs
        self.ca = ca

    def path(self, run: str, principal: Principal) -> Path:
        return self.folder / check_name("run", run) / f"{principal.value}.toml"

    def issue(
        self, run: str, principal: Principal, valid_for: datetime.timedelta | None = None
    ) -> Path:
        """The identity file of ``principal`` in ``run``, made on first use; with ``valid_for``,
        a new one (a new key: the one it replaces is refused from the broker's next reload)
        that expires then."""
        path = self.path(run, principal)
        if valid_for is not None or not path.exists():
            identity = Identity.new(run, principal, valid_for)
            if self.map_certs and self.ca is not None and self.ca.ca_key is not None:
                email = cert_user(run, principal)
                cert = client_certificate(
                    self.ca, email, path.with_suffix(".pem"), identity.expires
                )
                identity = replace(identity, cert=cert)
            identity.save(path)
        return path

    def issue_run(self, run: str) -> dict[Principal, Path]:
        """Every principal's identity file of ``run``."""
        return {p: self.issue(run, p) for p in Principal}

    def next_expiry(self) -> datetime.datetime | None:
        """When the first identity still valid expires (the broker reloads then)."""
        ahead = [
            identity.expires
            for identity in self._identities()
            if identity.expires is not None and not identity.expired()
        ]
        return min(ahead, default=None)

    def _identities(self) -> list[Identity]:
        return [Identity.load(p) for p in sorted(self.folder.glob("*/*.toml"))]

    def fingerprint(self) -> frozenset[tuple[str, float]]:
        """Changes when an identity file is added, replaced or removed."""
        if not self.folder.is_dir():
            return frozenset()
        return frozenset((str(p), p.stat().st_mtime) for p in self.folder.glob("*/*.toml"))

    def runs(self) -> list[str]:
        """Its runs, the first issued first."""
        if not self.folder.is_dir():
            return []
        issued = {
            d.name: min((f.stat().st_mtime for f in d.glob("*.toml")), default=float("inf"))
            for d in self.folder.iterdir()
            if d.is_dir()
        }
        return sorted(issued, key=lambda run: (issued[run], run))

    def fitting(self, storage: int, memory: int) -> tuple[list[str], list[str]]:
        """The runs whose accounts fit a server of ``storage`` and ``memory`` bytes of
        JetStream, the first issued first, and the rest. nats-server reserves each account's
        limits, and an account that does not fit turns JetStream off for every account."""
        runs = self.runs()
        fit = len(runs)
        if self.limits.max_file:
            fit = min(fit, storage // self.limits.max_file)
        if self.limits.max_memory:
            fit = min(fit, memory // self.limits.max_memory)
        return runs[:fit], runs[fit:]

    def accounts(self, runs: list[str] | None = None) -> dict:
        """nats-server's ``accounts`` block: one account per run (of ``runs``; default: every
        run), its users with their rights."""
        accounts = {}
        for run in self.runs() if runs is None else runs:
            names = RunNames(run)
            users = []
            for principal in Principal:
                path = self.path(run, principal)
                if not path.exists() or (identity := Identity.load(path)).expired():
                    continue
                granted = rights(names, principal)
                allowed = {} if granted is None else {"permissions": granted.nats()}
                users.append({"nkey": identity.public_key, **allowed})
                if self.map_certs:
                    users.append({"user": cert_user(run, principal), **allowed})
            accounts[account_name(run)] = {"jetstream": self.limits.nats(), "users": users}
        return accounts

    def server_accounts(self, runs: list[str] | None = None) -> dict:
        """``accounts`` plus ``SF_NOBODY``, an account whose one user's seed nobody keeps: it
        turns authorization on even before the first run's identities exist (until then every
        connection is refused). What a server's config holds (public keys only)."""
        nobody = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        nobody_account = {"users": [{"nkey": nobody.public_key.decode()}]}
        return {**self.accounts(runs), "SF_NOBODY": nobody_account}

    def write_accounts(self, path: Path) -> Path:
        """``server_accounts`` as a nats-server config file of its own, ``accounts: <JSON>``
        (the config format accepts JSON values), for a server config that ``include``s it."""
        text = (
            "# Every run's account, written by `seamlessflow creds --accounts`: public keys and\n"
            "# rights only.\n"
            f"accounts: {json.dumps(self.server_accounts(), indent=2)}\n"
        )
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text(text)
        tmp.replace(path)
        return path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def write_routes(path: Path, routes: list[str]) -> Path:
    """A route cluster's credentials, as the contents of nats-server's ``cluster`` block (which
    ``include``s the file): a fresh random secret that a server must present to join, and
    ``routes`` (``host:port`` each) that present it. Mode 0600."""
    secret = secrets.token_urlsafe(24)
    urls = "".join(f"  nats://route:{secret}@{route}\n" for route in routes)
    return write_private(
        path,
        "# The route cluster's secret (seamlessflow creds --routes): only a server that knows\n"
        "# it joins. Keep this file as private as the identities.\n"
        f'authorization {{ user: route, password: "{secret}", timeout: 2 }}\n'
        f"routes: [\n{urls}]\n",
    )
