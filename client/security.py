"""How gelastic's processes prove who they are: tokens and TLS settings, shared by all three.

A token is a shared secret read from a file and sent as `authorization: Bearer <token>` call
metadata; the coordinator compares it in constant time. TLS is the standard grpc channel
credentials, optionally with a client certificate (mTLS).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
import grpc.aio

__all__ = ["AUTH_HEADER", "Security", "read_token"]

AUTH_HEADER = "authorization"
MAX_TOKEN_BYTES = 4096


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

    @classmethod
    def from_files(
        cls,
        token_file: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
    ) -> Security:
        token = read_token(token_file) if token_file else ""
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if tls_cert and not tls_ca:
            raise ValueError("a client certificate (--tls-cert) needs --tls-ca")
        return cls(token, tls_ca, tls_cert, tls_key, tls_server_name)

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
        if not self.tls_ca:
            return None
        root = Path(self.tls_ca).read_bytes()
        key = Path(self.tls_key).read_bytes() if self.tls_key else None
        cert = Path(self.tls_cert).read_bytes() if self.tls_cert else None
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )

    def _options(self, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
        out = list(options)
        if self.tls_server_name:
            out.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return out

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        creds = self._credentials()
        if creds is None:
            return grpc.insecure_channel(target, options=self._options(options))
        return grpc.secure_channel(target, creds, options=self._options(options))

    def aio_channel(
        self, target: str, options: Sequence[tuple[str, object]] = ()
    ) -> grpc.aio.Channel:
        creds = self._credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target, options=self._options(options))
        return grpc.aio.secure_channel(target, creds, options=self._options(options))
