"""TLS on a live nats-server (each binary found): a throwaway CA, a client that trusts it,
clients that must fail closed, and mutual TLS mapping certificates to identities."""

import asyncio
import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from cryptography import x509
from nats.errors import Error as NatsError

from broker.auth import cert_user
from broker.client import session
from broker.exceptions import BrokerTlsError
from broker.permissions import Principal, inbox_prefix
from broker.server import EmbeddedBroker
from broker.subjects import RunNames
from broker.tls import CA_ENV, client_certificate, client_context, throwaway_pki
from tests.support import broker_config, secure_run

RUN = "tlsrun"


@pytest.fixture(scope="module")
def tls_broker(
    nats_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedBroker]:
    config = broker_config(
        tmp_path_factory.mktemp("tls"),
        nats_binary,
        tls_generate=True,
        host="0.0.0.0",
    )
    broker = EmbeddedBroker(config)
    broker.authority.issue_run(RUN)
    with broker:
        yield broker


def _monitor(broker: EmbeddedBroker, path: str) -> dict:
    with urllib.request.urlopen(f"{broker.monitoring_url}/{path}", timeout=5) as r:
        return json.load(r)


def _admin(broker: EmbeddedBroker) -> Path:
    return broker.authority.path(RUN, Principal.ADMIN)


async def test_a_client_that_trusts_the_ca_connects_over_tls(tls_broker, monkeypatch):
    monkeypatch.setenv(CA_ENV, str(tls_broker.tls.ca))
    async with session(tls_broker.url, "tls-ok", identity_file=_admin(tls_broker)) as nc:
        assert nc.is_connected
        conns = _monitor(tls_broker, "connz?acc=SF_tlsrun")["connections"]
        versions = [c.get("tls_version") for c in conns if c.get("name") == "tls-ok"]
        assert versions in (["1.2"], ["1.3"]), conns
    assert tls_broker.tls.key.stat().st_mode & 0o777 == 0o600


async def test_a_client_with_another_ca_or_none_fails_closed(tls_broker, monkeypatch, tmp_path):
    other = throwaway_pki(tmp_path / "other")
    monkeypatch.setenv(CA_ENV, str(other.ca))
    with pytest.raises(BrokerTlsError, match="certificate verify failed"):
        async with session(tls_broker.url, "tls-wrong", identity_file=_admin(tls_broker)):
            pass
    monkeypatch.delenv(CA_ENV)
    with pytest.raises(BrokerTlsError, match=CA_ENV):
        async with session(tls_broker.url, "tls-none", identity_file=_admin(tls_broker)):
            pass


def test_the_monitoring_port_stays_on_loopback(tls_broker):
    """Clients may listen on every address; the monitoring port (it answers anyone) does not."""
    assert tls_broker.monitoring_url.startswith("http://127.0.0.1:")
    varz = _monitor(tls_broker, "varz")
    assert varz["http_host"] == "127.0.0.1" and varz["host"] == "0.0.0.0"
    assert varz["tls_required"] is True


@pytest.fixture(scope="module")
def mapped_broker(
    nats_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedBroker]:
    """Mutual TLS mapped to identities (verify_and_map), with run ``RUN`` provisioned."""
    config = broker_config(
        tmp_path_factory.mktemp("mtls"),
        nats_binary,
        tls_generate=True,
        tls_map=True,
    )
    with EmbeddedBroker(config) as broker:
        asyncio.run(secure_run(broker, RUN))
        yield broker


async def _cert_only(broker: EmbeddedBroker, cert: Path | None, errors: list[str]):
    """A plain nats-py connection presenting ``cert`` and no nkey (replies to the worker's
    inbox: the only one a worker may subscribe to)."""

    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        broker.url,
        tls=client_context(broker.tls.ca, cert),
        error_cb=error_cb,
        allow_reconnect=False,
        connect_timeout=2,
        inbox_prefix=inbox_prefix(RUN, Principal.WORKER),
    )


async def test_a_client_certificate_is_its_principal_without_an_nkey(mapped_broker):
    """A certificate of the broker's CA whose email address is ``worker@<run>.seamlessflow``
    connects with the worker's rights: it may ask JetStream about the generation stream and
    may not publish weights."""
    names = RunNames(RUN)
    worker = mapped_broker.authority.path(RUN, Principal.WORKER).with_suffix(".pem")
    assert worker.stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate(worker.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.RFC822Name) == [cert_user(RUN, Principal.WORKER)]
    errors: list[str] = []
    nc = await _cert_only(mapped_broker, worker, errors)
    try:
        await nc.publish(names.weights, b"forged")
        await nc.flush()
        await asyncio.sleep(0.5)
        assert any(f'publish to "{names.weights}"' in e for e in errors), errors
        info = await nc.jetstream(timeout=5).stream_info(names.gen_stream)
        assert info.config.name == names.gen_stream
    finally:
        await nc.close()
    # an identity file's connection presents its certificate too (the server requires one)
    async with session(
        mapped_broker.url,
        "mtls-trainer",
        identity_file=mapped_broker.authority.path(RUN, Principal.TRAINER),
        ca_file=mapped_broker.tls.ca,
    ) as trainer:
        assert trainer.is_connected


async def test_no_certificate_or_another_cas_is_refused(mapped_broker, tmp_path):
    errors: list[str] = []
    with pytest.raises((ssl.SSLError, OSError, NatsError)):
        await _cert_only(mapped_broker, None, errors)
    other = throwaway_pki(tmp_path / "other")
    stranger = client_certificate(other, cert_user(RUN, Principal.ADMIN), tmp_path / "stranger.pem")
    with pytest.raises((ssl.SSLError, OSError, NatsError)):
        await _cert_only(mapped_broker, stranger, errors)
    # the broker's CA, a user it does not know
    unknown = client_certificate(
        mapped_broker.tls, "nobody@elsewhere.seamlessflow", tmp_path / "u.pem"
    )
    with pytest.raises((ssl.SSLError, OSError, NatsError)):
        await _cert_only(mapped_broker, unknown, errors)
    assert any("authorization violation" in e.lower() for e in errors), errors
