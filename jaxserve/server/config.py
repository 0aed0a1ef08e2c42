"""`jaxserve run` configuration: engine options at the top level of the YAML file plus a
``server:`` section. Unknown keys and bad values are rejected at start-up, by name."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any

from jaxserve.config import EngineConfig, Rule, above, at_least, check_types, from_options, option, read_config_file
from jaxserve.errors import ConfigError

# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def valid_host(host: str) -> bool:
    """An IP address (v4 or v6, no brackets) or a host name; never ``host:port`` or blanks."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST_NAME.match(host))


_READABLE = Rule(lambda path: Path(path).is_file(), "the path of a readable file")
_PORT = Rule(lambda v: 0 <= v < 65536, "an integer in [0, 65535]")


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option(
        "127.0.0.1",
        "gRPC, HTTP and metrics listen here only (loopback by default).",
        Rule(valid_host, "an IP address or a host name, without a port (e.g. 127.0.0.1, ::1)"),
    )
    port: int = option(50051, "gRPC port (0: any free port).", _PORT)
    metrics_port: int | None = option(9090, "Prometheus text format over HTTP (null: off).", _PORT)
    http_port: int | None = option(
        8000, "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions...) on server.host (null: off).", _PORT
    )
    http_keep_alive_seconds: float = option(
        75.0,
        "An idle HTTP connection stays open this long. Above the idle times of common clients (httpx and "
        "the openai client: 5 s) and load balancers (60 s): a server that closes first can race a request "
        'sent on the closing connection ("connection reset").',
        above(0, "a number of seconds"),
    )
    max_waiting_requests: int = option(256, "Beyond this, new requests get RESOURCE_EXHAUSTED.", at_least(1))
    drain_grace_seconds: float = option(
        30.0, "On SIGTERM, in-flight requests may finish for this long.", at_least(0, "a number")
    )
    warmup: bool = option(True, "Compile every bucket before reporting SERVING.")
    max_request_bytes: int = option(
        16 * 1024 * 1024,
        "Largest request in bytes: an HTTP body (larger: 413) or a gRPC message (RESOURCE_EXHAUSTED).",
        at_least(1024),
    )
    max_prompt_chars: int = option(1_000_000, "Longest text prompt, checked before tokenizing.", at_least(1))
    max_prompt_tokens: int | None = option(None, "Longest prompt in tokens (null: max_model_len - 1).", at_least(1))
    max_tokens_limit: int | None = option(None, "Cap on a request's max_tokens (null: the context).", at_least(1))
    max_requests_per_client: int = option(
        128,
        "Requests of one client in flight (waiting or running). A client is its authenticated identity "
        "(auth_tokens_file), or its peer address.",
        at_least(1),
    )
    max_queued_tokens_per_client: int = option(
        2_000_000, "Prompt + max_tokens of one client's requests in flight.", at_least(2)
    )
    tls_cert_file: str | None = option(None, "PEM server certificate (chain); with tls_key_file.", _READABLE)
    tls_key_file: str | None = option(None, "PEM private key of tls_cert_file.", _READABLE)
    tls_client_ca_file: str | None = option(
        None, "PEM CA: clients must present a certificate it signed (mutual TLS).", _READABLE
    )
    auth_tokens_file: str | None = option(
        None, "Lines of `identity token`; calls must send `authorization: Bearer <token>` metadata.", _READABLE
    )

    def __post_init__(self) -> None:
        # Pairs first: "give both" says more than "no such file" about half a pair.
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("server.tls_cert_file and server.tls_key_file: give both (TLS) or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("server.tls_client_ca_file: mutual TLS needs server.tls_cert_file and tls_key_file")
        check_types(self, "server.")
        # gRPC says only "failed to bind" about a file that is not PEM: say which one it is.
        for key, marker in (
            ("tls_cert_file", b"-----BEGIN CERTIFICATE-----"),
            ("tls_client_ca_file", b"-----BEGIN CERTIFICATE-----"),
            ("tls_key_file", b"PRIVATE KEY-----"),
        ):
            path = getattr(self, key)
            if path is not None and marker not in Path(path).read_bytes():
                raise ConfigError(f"server.{key} = {path!r}: must be a PEM file holding a {marker.decode()!r} block")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


def load_run_config(
    path: str | None, overrides: list[str] = (), **engine_options: Any
) -> tuple[EngineConfig, ServerConfig]:
    """Reads the YAML file (if any), applies ``key=value`` overrides (``server.port=1``) and
    then ``engine_options``; returns the engine and server configurations."""
    data = read_config_file(path, overrides)
    data.update(engine_options)
    server = data.pop("server", None) or {}
    if not isinstance(server, dict):
        raise ConfigError("server: must be a mapping")
    return EngineConfig.from_options(**data), from_options(ServerConfig, server, "server")
