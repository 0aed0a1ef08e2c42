"""Who is calling: bearer-token authentication and the client identity limits apply to.

With ``server.auth_tokens_file`` every call except the health check must carry
``authorization: Bearer <token>`` metadata; the token names an identity (the file's lines
are ``identity token``). Without it, a client is its peer address. Tokens are compared in
constant time against every known token, so timing says nothing about how close a guess
came or which identity it was near.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from jaxserve.errors import ConfigError


def read_tokens(path: str) -> dict[str, bytes]:
    """identity -> token from a file of ``identity token`` lines (``#`` comments, blanks ok)."""
    tokens: dict[str, bytes] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < 16:
            raise ConfigError(
                f"server.auth_tokens_file {path}, line {n}: expected `identity token` with a token of "
                f"at least 16 characters"
            )
        identity, token = parts
        if identity in tokens:
            raise ConfigError(f"server.auth_tokens_file {path}, line {n}: identity {identity!r} appears twice")
        tokens[identity] = token.encode()
    if not tokens:
        raise ConfigError(f"server.auth_tokens_file {path}: no `identity token` lines")
    return tokens


def _bearer(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, token = value.partition(" ")
            return token.strip().encode() if scheme.lower() == "bearer" else None
    return None


class TokenAuth:
    def __init__(self, tokens: dict[str, bytes]):
        self._tokens = list(tokens.items())

    def identity(self, metadata) -> str | None:
        """The identity whose token the call carries, or None."""
        token = _bearer(metadata)
        if token is None:
            return None
        found = None
        for identity, known in self._tokens:  # no early exit: every token is compared
            if hmac.compare_digest(token, known):
                found = identity
        return found


def peer_identity(context) -> str:
    """A client without authentication: its address without the port (``ipv4:127.0.0.1``)."""
    peer = context.peer() or "unknown"
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() else peer
