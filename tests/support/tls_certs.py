"""Certificates made in the test, as a deployment has them: a private authority and a
server certificate for 127.0.0.1 and localhost that it signed (``cryptography``)."""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.transport.tls import TlsFiles


@dataclass(frozen=True)
class Pki:
    """Files in one folder: ``ca.pem`` (what clients trust), ``cert.pem``, ``key.pem``."""

    ca: Path
    files: TlsFiles
    serial: int  # of the server certificate: which one a client was shown
    spki_sha256: str  # base64, for Chromium's --ignore-certificate-errors-spki-list

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_pki(folder: Path, *, password: bytes | None = None, tag: str = "") -> Pki:
    """A new authority and server certificate in ``folder`` (``tag`` prefixes the file
    names, so that two sets can sit side by side); the key encrypted with ``password``."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("gateway test authority"))
        .issuer_name(_name("gateway test authority"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password is not None
        else serialization.NoEncryption()
    )
    pem = serialization.Encoding.PEM
    ca_path, cert_path, key_path = (folder / f"{tag}{n}.pem" for n in ("ca", "cert", "key"))
    ca_path.write_bytes(ca.public_bytes(pem))
    cert_path.write_bytes(cert.public_bytes(pem))
    key_path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, encryption))
    password_file = None
    if password is not None:
        password_file = folder / f"{tag}password.txt"
        password_file.write_bytes(password + b"\n")
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return Pki(
        ca_path,
        TlsFiles(cert_path, key_path, password_file),
        cert.serial_number,
        base64.b64encode(hashlib.sha256(spki).digest()).decode(),
    )
