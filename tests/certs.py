"""A throwaway certificate authority for TLS tests: a CA, a server certificate for
127.0.0.1 / localhost and a client certificate, all made on the spot (PEM bytes)."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(subject: str, key, issuer_name, issuer_key, *, ca=False, sans=(), usage=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def make_pki() -> dict[str, bytes]:
    """PEM bytes: ca_cert, server_cert, server_key, client_cert, client_key."""
    ca_key = _key()
    ca = _cert("jaxserve test CA", ca_key, None, None, ca=True)
    server_key, client_key = _key(), _key()
    sans = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server = _cert("localhost", server_key, ca.subject, ca_key, sans=sans, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _cert("test client", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    return {
        "ca_cert": ca.public_bytes(pem),
        "server_cert": server.public_bytes(pem),
        "server_key": _pem_key(server_key),
        "client_cert": client.public_bytes(pem),
        "client_key": _pem_key(client_key),
    }
