"""TLS on the gateway's own port: ``https://`` and ``wss://`` through the standard
library's ``ssl``, so that clients that always dial ``wss://`` (openai-node's Realtime
client, any page served over https) reach the gateway with no proxy in front.

Who owns what: :class:`TlsFiles` names the PEM files (the command line's); the gateway
holds one live :class:`ssl.SSLContext` made by :func:`server_context` for its listening
socket, and :func:`reload` loads new files into that same context on SIGHUP, so
connections made after the reload get the new certificate and those already open keep
theirs. :func:`self_signed` makes a certificate for local development.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SELF_SIGNED_NAMES = ("localhost", "127.0.0.1", "::1")
SELF_SIGNED_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=7)  # a kept certificate closer to its end is remade
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
TLS_DIR_ENV_VAR = "LLM_GATEWAY_TLS_DIR"


class TlsError(Exception):
    """A certificate or key that cannot be used; the message is one line that says which
    file and what to do."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path  # PEM: the certificate, then any intermediates
    key: Path  # PEM private key, may be encrypted
    password_file: Path | None = None  # its first line is the key's password


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context for ``files``: TLS 1.2 or newer, ALPN ``http/1.1`` (WebSocket
    upgrades are HTTP/1.1; a client offering only h2 is refused in the handshake)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    _load(context, files)
    return context


def reload(context: ssl.SSLContext, files: TlsFiles) -> None:
    """Load ``files`` into the live ``context``, or raise :class:`TlsError` and leave it
    as it was. They are checked in a scratch context first: a failing
    ``load_cert_chain`` may have replaced the certificate but not the key."""
    _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), files)
    _load(context, files)


def describe(files: TlsFiles) -> dict[str, object]:
    """What ``/healthz`` says of the certificate: its file, the names it is good for, and
    when it ends (a monitor warns before it does)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    except (OSError, ValueError):
        return {"certificate": str(files.cert)}
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(name.value) for name in san]
    except x509.ExtensionNotFound:
        names = []
    return {
        "certificate": str(files.cert),
        "names": names,
        "not_after": cert.not_valid_after_utc.isoformat(),
    }


def _load(context: ssl.SSLContext, files: TlsFiles) -> None:
    for flag, path in (("--tls-cert", files.cert), ("--tls-key", files.key)):
        _readable(flag, path)
    password = _password(files)
    try:
        context.load_cert_chain(files.cert, files.key, password=password)
    except ssl.SSLError as exc:
        raise TlsError(_describe(exc, files)) from exc


def _readable(flag: str, path: Path) -> None:
    try:
        with path.open("rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise TlsError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise TlsError(f"{flag} {path}: a directory, not a PEM file") from None
    except OSError as exc:
        raise TlsError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


def _password(files: TlsFiles) -> Callable[[], bytes]:
    """The key's password, as a callable: OpenSSL then never prompts on the terminal
    (it would, for an encrypted key loaded with no password)."""
    if files.password_file is None:
        return lambda: b""
    _readable("--tls-key-password-file", files.password_file)
    lines = files.password_file.read_bytes().splitlines()
    secret = lines[0] if lines else b""
    return lambda: secret


def _describe(exc: ssl.SSLError, files: TlsFiles) -> str:
    from cryptography import x509

    try:
        x509.load_pem_x509_certificates(_contents(files.cert))
    except ValueError:
        return f"--tls-cert {files.cert}: not a PEM certificate"
    if exc.reason == "KEY_VALUES_MISMATCH":
        return f"--tls-key {files.key} is not the key of --tls-cert {files.cert}"
    # PKCS#8's "ENCRYPTED PRIVATE KEY", or the older "Proc-Type: 4,ENCRYPTED" header.
    if b"ENCRYPTED" in _contents(files.key)[:4096]:
        if files.password_file is None:
            return f"--tls-key {files.key} is encrypted: give --tls-key-password-file"
        return f"--tls-key-password-file {files.password_file}: not the key's password"
    return f"--tls-key {files.key}: not a PEM private key ({exc.reason or exc})"


def _contents(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


# -- a certificate for local development -----------------------------------------------


def default_dir() -> Path:
    """Where ``--tls-self-signed`` keeps its certificate when given no folder: kept across
    restarts, so that it is trusted once."""
    if configured := os.environ.get(TLS_DIR_ENV_VAR):
        return Path(configured)
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "llm-gateway" / "tls"


def self_signed(directory: Path) -> TlsFiles:
    """A self-signed certificate for localhost, 127.0.0.1 and ::1 in ``directory``: the
    one already there while it is good for another week, else a new one (an EC P-256
    key, readable only by this user)."""
    files = TlsFiles(directory / CERT_FILE, directory / KEY_FILE)
    if _still_good(files):
        return files
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        cert, key = _make_self_signed()
        # Each file is written whole and renamed into place: workers started together
        # read either the old pair or the new one, never half a file.
        _write_atomically(files.key, key, mode=0o600)
        _write_atomically(files.cert, cert, mode=0o644)
    except OSError as exc:
        raise TlsError(
            f"--tls-self-signed {directory}: cannot write the certificate there ({exc.strerror})"
        ) from None
    return files


def _still_good(files: TlsFiles) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        server_context(files)  # the key is there and matches
    except (OSError, ValueError, TlsError):
        return False
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    return left > RENEW_BEFORE


def _make_self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    alt_names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SELF_SIGNED_NAMES[1:]]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        # Its own authority, as `openssl req -x509` makes it: trust stores (Node's
        # NODE_EXTRA_CA_CERTS, a browser's authorities) take it as a root.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _write_atomically(path: Path, data: bytes, *, mode: int) -> None:
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
