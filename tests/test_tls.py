"""TLS on a live nats-server (each binary found): a throwaway CA, a client that trusts it, and
clients that must fail closed."""

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import session
from broker.exceptions import BrokerTlsError
from broker.permissions import Principal
from broker.server import EmbeddedBroker
from broker.tls import CA_ENV, throwaway_pki
from tests.support import broker_config

RUN = "tlsrun"


@pytest.fixture(scope="module")
def tls_broker(
    nats_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedBroker]:
    config = broker_config(
        tmp_path_factory.mktemp("tls"),
        nats_binary,
        insecure=False,
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
