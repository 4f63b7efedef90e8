"""Test PKI: a CA, a server certificate for 127.0.0.1/localhost, a client certificate, made on the spot."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import pytest

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


@dataclass
class PKI:
    dir: Path
    ca: Path  # the CA that signs the server certificate (Prometheus' tls_config.ca_file)
    cert: Path
    key: Path
    client_ca: Path  # the CA that signs client certificates (client_ca_file)
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by a CA the server does not trust
    other_client_key: Path


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject_key,
    cn: str,
    issuer_key=None,
    issuer_cn: str | None = None,
    ca: bool = False,
    server: bool = False,
    client: bool = False,
):
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(issuer_cn or cn))
        .public_key(subject_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
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
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(subject_key.public_key()), critical=False)
    if server:
        import ipaddress

        b = b.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    if issuer_key is not None and not ca:
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    return b.sign(issuer_key or subject_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        path.chmod(0o600)
    return path


def make_pki(d: Path) -> PKI:
    d.mkdir(parents=True, exist_ok=True)
    ca_key, cca_key, other_key = _key(), _key(), _key()
    ca = _cert(ca_key, "vramwatch test CA", ca=True)
    cca = _cert(cca_key, "vramwatch test client CA", ca=True)
    skey, ckey, okey = _key(), _key(), _key()
    server = _cert(skey, "localhost", ca_key, "vramwatch test CA", server=True)
    client = _cert(ckey, "prometheus", cca_key, "vramwatch test client CA", client=True)
    other_client = _cert(okey, "intruder", other_key, "untrusted CA", client=True)
    return PKI(
        d,
        _write(d / "ca.crt", ca),
        _write(d / "server.crt", server),
        _write(d / "server.key", key=skey),
        _write(d / "client-ca.crt", cca),
        _write(d / "client.crt", client),
        _write(d / "client.key", key=ckey),
        _write(d / "other-client.crt", other_client),
        _write(d / "other-client.key", key=okey),
    )
