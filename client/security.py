"""How gelastic's processes prove who they are: tokens and TLS settings, shared by all three.

A token is a shared secret read from a file and sent as `authorization: Bearer <token>` call
metadata; the coordinator compares it in constant time. TLS is the standard grpc channel
credentials, optionally with a client certificate (mTLS). TLS without a CA file verifies the
coordinator against the system trust store. A token is never sent in plain text to an address
off this host unless `insecure` says so.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
import grpc.aio

__all__ = [
    "AUTH_HEADER",
    "Security",
    "check_tls_files",
    "describe_tls_failure",
    "is_loopback",
    "new_token_file",
    "read_token",
    "system_trust_store",
    "target_hosts",
]

AUTH_HEADER = "authorization"
MAX_TOKEN_BYTES = 4096
MAX_TRUST_STORE_BYTES = 16 * 1024 * 1024
"""The system trust store is read whole; past this size it is refused rather than read."""
MAX_TRUST_STORE_FILES = 10_000
"""Entries of the trust store's directory looked at."""
_TRUE = ("1", "true", "yes", "on")
MAX_PEM_BYTES = 1024 * 1024
"""A certificate, key or CA file larger than this is refused rather than read."""
PROBE_TIMEOUT_S = 3.0
"""Bound of the one-off handshake `describe_tls_failure` makes to learn why TLS failed."""


def is_loopback(host: str) -> bool:
    """True when `host` (a name or address) means this host only."""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except OSError:
            return False


def target_hosts(target: str) -> list[str]:
    """The hosts of a gRPC target (HOST:PORT, [V6]:PORT, dns:, ipv4: and ipv6: forms, lists of
    addresses); none for a unix socket, which never leaves this host."""
    t = target.strip()
    if t.startswith(("unix:", "unix-abstract:")):
        return []
    parts = [t]
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            parts = t[len(scheme) :].split(",")[:64]
            break
    hosts = []
    for part in parts:
        if part.startswith("["):
            hosts.append(part[1:].split("]")[0])
        elif part.count(":") > 1:  # a bare IPv6 address without a port
            hosts.append(part)
        else:
            hosts.append(part.rpartition(":")[0] if ":" in part else part)
    return hosts


def system_trust_store() -> bytes:
    """The PEM certificates of this host's trust store (what OpenSSL verifies with by default).

    grpc otherwise trusts a root bundle of its own; a coordinator certificate signed by a CA the
    operator installed on the host is found here. Raises ValueError when there is none.
    """
    import ssl  # here, not at the top: the agent keeps ssl out unless it needs it

    paths = ssl.get_default_verify_paths()
    # OpenSSL's default: the CA file ($SSL_CERT_FILE) and the CA directory ($SSL_CERT_DIR).
    files: list[Path] = []
    if paths.cafile:
        files.append(Path(paths.cafile))
    if paths.capath and os.path.isdir(paths.capath):
        entries = itertools.islice(Path(paths.capath).iterdir(), MAX_TRUST_STORE_FILES)
        files.extend(sorted(p for p in entries if p.suffix in (".pem", ".crt") and p.is_file()))
    data = bytearray()
    for f in files:
        try:
            with f.open("rb") as fh:
                chunk = fh.read(MAX_TRUST_STORE_BYTES + 1 - len(data))
        except OSError:
            continue
        data += chunk
        if len(data) > MAX_TRUST_STORE_BYTES:
            raise ValueError(
                f"the system trust store is larger than {MAX_TRUST_STORE_BYTES} bytes: "
                "pass --tls-ca"
            )
        data += b"\n"
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(
            "TLS without --tls-ca needs the system trust store, and none was found "
            f"(looked at {paths.cafile or paths.openssl_cafile}, {paths.capath or paths.openssl_capath}): "
            "pass --tls-ca"
        )
    return bytes(data)


def new_token_file(prefix: str = "gelastic-token-") -> Path:
    """A fresh random token in a new private temp dir (0700), in a file of its own (0600).

    The caller owns the directory (the file's parent) and removes it when done.
    """
    import secrets  # here: it imports hmac, which maps libcrypto (see client.results._tag)
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix=prefix))
    path = directory / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding white space stripped); raises ValueError naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read token file {p}: {exc.strerror or exc}") from None
    if len(data) > MAX_TOKEN_BYTES:
        raise ValueError(f"token file {p} is larger than {MAX_TOKEN_BYTES} bytes")
    token = data.decode("utf-8", errors="strict").strip()
    if len(token) < 16:
        raise ValueError(
            f"token in {p} is too short: use at least 16 characters (32+ random is better)"
        )
    if any(c.isspace() for c in token):
        raise ValueError(f"token in {p} must not contain white space")
    return token


def _read_pem(path: str, what: str, kinds: tuple[str, ...]) -> bytes:
    """The bytes of a PEM file holding one of `kinds`; ValueError naming the file and problem."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except PermissionError:
        raise ValueError(f"{what} {path}: not readable by this user (permission denied)") from None
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ValueError(f"{what} {path}: larger than {MAX_PEM_BYTES} bytes, not a PEM file")
    if not any(f"-----BEGIN {k}-----".encode() in data for k in kinds):
        held = "nothing PEM"
        if b"PRIVATE KEY-----" in data:
            held = "a private key"
        elif b"-----BEGIN CERTIFICATE-----" in data:
            held = "a certificate"
        raise ValueError(f"{what} {path}: not a PEM {kinds[0].lower()} (it holds {held})")
    return data


_KEY_KINDS = ("PRIVATE KEY", "EC PRIVATE KEY", "RSA PRIVATE KEY", "ENCRYPTED PRIVATE KEY")


def check_tls_files(
    cert: str = "", key: str = "", ca: str = "", *, flags: tuple[str, str, str] | None = None
) -> None:
    """Raise ValueError naming the option, the file and the problem unless every given file
    exists, is readable, holds what it should (PEM certificate, unencrypted key, CA) and the key
    belongs to the certificate. `flags` names the options (default --tls-cert/--tls-key/--tls-ca)."""
    f_cert, f_key, f_ca = flags or ("--tls-cert", "--tls-key", "--tls-ca")
    if bool(cert) != bool(key):
        raise ValueError(f"{f_cert} and {f_key} go together")
    if not (cert or ca):
        return
    import ssl  # here, not at the top: the agent keeps ssl out unless it uses TLS

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca:
        _read_pem(ca, f_ca, ("CERTIFICATE",))
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise ValueError(f"{f_ca} {ca}: not a usable CA certificate ({exc.reason})") from None
    if cert:
        _read_pem(cert, f_cert, ("CERTIFICATE",))
        key_data = _read_pem(key, f_key, _KEY_KINDS)
        if b"ENCRYPTED" in key_data:
            raise ValueError(
                f"{f_key} {key}: the key is encrypted with a passphrase; give an unencrypted "
                "key (in a file only this user can read, 0600)"
            )

        def no_passphrase() -> bytes:
            raise ValueError(f"{f_key} {key}: the key is encrypted with a passphrase")

        try:
            ctx.load_cert_chain(cert, key, password=no_passphrase)
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(
                    f"{f_key} {key}: this private key does not belong to the certificate "
                    f"{cert} ({f_cert})"
                ) from None
            raise ValueError(
                f"{f_cert} {cert} / {f_key} {key}: not a usable certificate and key "
                f"({exc.reason or exc})"
            ) from None


def _split_target(target: str) -> tuple[str, int] | None:
    hosts = target_hosts(target)
    if not hosts:
        return None
    t = target.strip()
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme) :].split(",")[0]
    port = t.rpartition(":")[2] if not t.endswith("]") else ""
    return (hosts[0], int(port)) if port.isdigit() and 0 < int(port) < 65536 else None


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """True when the server at host:port completes (or rejects with an alert) a TLS handshake."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            ctx.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "")
    except OSError:
        return False


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""The HTTP/2 client preface and an empty SETTINGS frame: what a gRPC server answers."""


def describe_tls_failure(target: str, security: Security, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Why a connection to `target` with these settings fails at the TLS layer, learnt from one
    handshake of our own (bounded by `timeout`); "" when TLS is not the problem (or unknown).

    grpc reports a failed handshake as UNAVAILABLE with at most "Socket closed": this names the
    reason (hostname mismatch, unknown CA, client certificate required, TLS meets plain text).
    """
    where = _split_target(target)
    if where is None:
        return ""
    host, port = where
    try:
        import ssl
    except ImportError:
        return ""
    if not security.uses_tls:
        if _speaks_tls(host, port, timeout):
            return (
                f"the coordinator at {target} speaks TLS and this side plain text: pass "
                "--tls-ca FILE (or --tls to verify it against the system trust store)"
            )
        return ""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2"])
    try:
        if security.tls_ca:
            ctx.load_verify_locations(cafile=security.tls_ca)
        else:
            ctx.load_verify_locations(cadata=system_trust_store().decode("ascii", "replace"))
        if security.tls_cert:
            ctx.load_cert_chain(security.tls_cert, security.tls_key)
    except (OSError, ValueError, ssl.SSLError):
        return ""
    name = security.tls_server_name or host
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            ctx.wrap_socket(raw, server_hostname=name) as tls,
        ):
            # TLS 1.3: the server judges the client certificate after the handshake; a gRPC
            # server that accepts it answers the HTTP/2 preface, one that does not hangs up.
            tls.sendall(_H2_PREFACE)
            answered = tls.recv(9)
    except ssl.SSLCertVerificationError as exc:
        msg = str(exc.verify_message or exc.reason or exc)
        if "hostname" in msg.lower() or "ip address mismatch" in msg.lower():
            return (
                f"the coordinator's certificate does not name {name!r} ({msg.rstrip('.')}): "
                "connect by a name it has, or pass --tls-server-name NAME"
            )
        ca = security.tls_ca or "the system trust store"
        return (
            f"the coordinator's certificate is not signed by a CA in {ca} ({msg}): "
            "pass the CA that signed it with --tls-ca"
        )
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc)
        if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL"):
            return (
                f"the coordinator at {target} speaks plain text and this side TLS: drop "
                "--tls-ca/--tls, or start the coordinator with --tls-cert and --tls-key"
            )
        if "CERTIFICATE_REQUIRED" in reason or (
            not security.tls_cert and "HANDSHAKE_FAILURE" in reason
        ):
            return (
                "the coordinator requires a client certificate (mTLS): pass --tls-cert and "
                "--tls-key"
            )
        if "ALERT" in reason and security.tls_cert:
            return (
                f"the coordinator refused the client certificate {security.tls_cert} "
                f"({reason}): it must be signed by the coordinator's --tls-client-ca"
            )
        return f"TLS handshake with {target} failed: {reason}"
    except (TimeoutError, OSError):
        return ""
    if answered:
        return ""
    if not security.tls_cert:
        return "the coordinator requires a client certificate (mTLS): pass --tls-cert and --tls-key"
    return (
        f"the coordinator hung up on the client certificate {security.tls_cert}: it must be "
        "signed by the CA the coordinator trusts (its --tls-client-ca)"
    )


@dataclass(frozen=True)
class Security:
    """What a client or agent presents to the coordinator."""

    token: str = field(default="", repr=False)
    """Shared secret sent with every call ("" = none); never in repr or str."""
    tls_ca: str = ""
    """PEM file of the CA that signed the coordinator's certificate ("" = plain text)."""
    tls_cert: str = ""
    """PEM client certificate for mTLS ("" = none)."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_server_name: str = ""
    """Override of the name checked in the coordinator's certificate."""
    tls: bool = False
    """Use TLS even without tls_ca, verifying the coordinator against the system trust store."""
    insecure: bool = False
    """Allow sending the token in plain text to an address off this host."""

    @classmethod
    def from_files(
        cls,
        token_file: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
        *,
        tls: bool = False,
        insecure: bool = False,
    ) -> Security:
        token = read_token(token_file) if token_file else ""
        if tls_server_name and not (tls or tls_ca or tls_cert):
            raise ValueError(
                "--tls-server-name names the coordinator's certificate, and there is none "
                "without TLS: add --tls-ca FILE (or --tls)"
            )
        # Checked here, at start: a missing or wrong file is one line now, not a retry forever.
        check_tls_files(tls_cert, tls_key, tls_ca)
        return cls(token, tls_ca, tls_cert, tls_key, tls_server_name, tls, insecure)

    @classmethod
    def from_env(
        cls,
        token_file: str | None = None,
        tls_ca: str | None = None,
        *,
        tls: bool | None = None,
        insecure: bool | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> Security:
        """Settings given here, else `$GELASTIC_TOKEN_FILE`, `$GELASTIC_TLS_CA`,
        `$GELASTIC_TLS_CERT`, `$GELASTIC_TLS_KEY`, `$GELASTIC_TLS_SERVER_NAME`, `$GELASTIC_TLS`
        and `$GELASTIC_INSECURE` (1/true/yes/on). Raises ValueError naming a bad file."""
        env = os.environ

        def flag(name: str) -> bool:
            return env.get(name, "").strip().lower() in _TRUE

        def value(given: str | None, name: str) -> str:
            return given if given is not None else env.get(name, "")

        return cls.from_files(
            value(token_file, "GELASTIC_TOKEN_FILE"),
            value(tls_ca, "GELASTIC_TLS_CA"),
            value(tls_cert, "GELASTIC_TLS_CERT"),
            value(tls_key, "GELASTIC_TLS_KEY"),
            value(tls_server_name, "GELASTIC_TLS_SERVER_NAME"),
            tls=tls if tls is not None else flag("GELASTIC_TLS"),
            insecure=insecure if insecure is not None else flag("GELASTIC_INSECURE"),
        )

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert)

    def check_target(self, target: str) -> None:
        """Raise ValueError if a call to `target` would carry the token in plain text off this host."""
        if not self.token or self.uses_tls or self.insecure:
            return
        if all(is_loopback(host) for host in target_hosts(target)):
            return
        raise ValueError(
            f"refusing to send the token in plain text to {target}: anyone on the network could "
            "read it. Use TLS (--tls-ca FILE, or --tls to verify against the system trust store), "
            "or --insecure ($GELASTIC_INSECURE=1) to accept the risk"
        )

    def __repr__(self) -> str:
        # A repr lands in logs and tracebacks: it says whether a token is set, never which.
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "token"
        )
        return f"Security(token_set={bool(self.token)}, {shown})"

    __str__ = __repr__

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not self.uses_tls:
            return None
        root = (
            _read_pem(self.tls_ca, "--tls-ca", ("CERTIFICATE",))
            if self.tls_ca
            else system_trust_store()
        )
        key = _read_pem(self.tls_key, "--tls-key", _KEY_KINDS) if self.tls_key else None
        cert = _read_pem(self.tls_cert, "--tls-cert", ("CERTIFICATE",)) if self.tls_cert else None
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )

    def _options(self, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
        out = list(options)
        if self.tls_server_name:
            out.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return out

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        self.check_target(target)
        creds = self._credentials()
        if creds is None:
            return grpc.insecure_channel(target, options=self._options(options))
        return grpc.secure_channel(target, creds, options=self._options(options))

    def aio_channel(
        self, target: str, options: Sequence[tuple[str, object]] = ()
    ) -> grpc.aio.Channel:
        self.check_target(target)
        creds = self._credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target, options=self._options(options))
        return grpc.aio.secure_channel(target, creds, options=self._options(options))
