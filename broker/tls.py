"""TLS for the broker: a throwaway certificate authority for a local run, and the client side.

``seamlessflow broker --tls`` (``[broker] tls_generate``) makes a CA and a server certificate
for loopback and this host in ``<state_dir>/tls`` (private keys mode 0600), once: a restart
keeps them; bring your own with ``tls_cert``, ``tls_key`` and ``tls_ca`` instead. Clients verify
the server against the CA named by ``$SEAMLESSFLOW_NATS_CA`` and refuse a server it did not sign
(``connect``: fails closed).

Mutual TLS (``--tls-map``, nats-server's ``verify_and_map``): every client presents a
certificate of that CA, and one whose email address (SAN) names a user of the broker is that
user, without an nkey (``broker.auth.cert_user``). ``client_certificate`` issues one from the
throwaway CA.
"""

import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_ENV = "SEAMLESSFLOW_NATS_CA"
"""The CA file a client verifies the broker's certificate with; unset: plain TCP."""
VALID_DAYS = 30


@dataclass(frozen=True)
class ServerFiles:
    cert: Path
    key: Path
    ca: Path
    ca_key: Path | None = None
    """The CA's private key when the broker made the CA (it may issue client certificates)."""


def client_context(ca: Path, cert: Path | None = None) -> ssl.SSLContext:
    """Verify the server against ``ca`` only (not the system's CAs), hostname included; present
    ``cert`` (certificate and private key in one PEM file) for mutual TLS."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        context.load_cert_chain(cert)
    return context


def throwaway_pki(folder: Path, hosts: list[str] | None = None) -> ServerFiles:
    """A CA and a server certificate signed by it, for ``hosts`` (default: localhost,
    127.0.0.1, ::1 and this host's name), valid ``VALID_DAYS`` days; those already in
    ``folder`` when they are all there (the client certificates issued stay valid)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = ServerFiles(
        folder / "server.pem", folder / "server-key.pem", folder / "ca.pem", folder / "ca-key.pem"
    )
    if all(path.is_file() for path in (files.cert, files.key, files.ca, files.ca_key)):
        return files
    hosts = hosts or ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SeamlessFlow throwaway CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [_san(h) for h in dict.fromkeys(hosts)]
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = (
        _builder(server_name, ca_name, key.public_key(), now)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            # client too: a cluster's servers present it to each other on routes
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(files.ca, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files.key, _pem_key(key), 0o600)
    _write(files.ca_key, _pem_key(ca_key), 0o600)
    return files


def client_certificate(
    ca: ServerFiles, email: str, path: Path, expires: datetime.datetime | None = None
) -> Path:
    """A client certificate signed by ``ca`` (made by ``throwaway_pki``) whose email address is
    ``email``, with its private key, as one PEM file at ``path``, mode 0600; valid until
    ``expires`` (default: ``VALID_DAYS``)."""
    if ca.ca_key is None:
        raise ValueError(
            f"the CA {ca.ca} has no private key here: issue client certificates with your own PKI"
        )
    ca_cert = x509.load_pem_x509_certificate(ca.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, email)])
    cert = (
        _builder(name, ca_cert.subject, key.public_key(), now, expires)
        .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(email)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write(path, cert.public_bytes(serialization.Encoding.PEM) + _pem_key(key), 0o600)
    return path


def _builder(
    subject, issuer, public_key, now: datetime.datetime, expires: datetime.datetime | None = None
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(expires or now + datetime.timedelta(days=VALID_DAYS))
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
