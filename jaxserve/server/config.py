"""`jaxserve run` configuration: engine options at the top level of the YAML file plus a
``server:`` section. Unknown keys and bad values are rejected at start-up, by name."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any

from jaxserve.config import EngineConfig, check_types, read_config_file
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


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # gRPC and metrics listen here only
    port: int = 50051
    metrics_port: int | None = 9090  # Prometheus text format over HTTP; null = off
    max_waiting_requests: int = 256  # beyond this, new requests get RESOURCE_EXHAUSTED
    drain_grace_seconds: float = 30.0  # SIGTERM: let in-flight requests finish this long
    warmup: bool = True  # compile every bucket before reporting SERVING
    # -- limits (RESOURCE_EXHAUSTED / INVALID_ARGUMENT naming the limit) ----------------
    max_prompt_chars: int = 1_000_000  # checked before tokenizing
    max_prompt_tokens: int | None = None  # null = max_model_len - 1
    max_tokens_limit: int | None = None  # cap on a request's max_tokens; null = the context
    # A client is its authenticated identity (auth_tokens_file), or its peer address.
    max_requests_per_client: int = 128  # in flight (waiting or running) at once
    max_queued_tokens_per_client: int = 2_000_000  # prompt + max_tokens of its requests in flight
    # -- security ----------------------------------------------------------------------
    tls_cert_file: str | None = None  # PEM server certificate (chain); with tls_key_file
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # PEM CA: clients must present a certificate it signed
    # Lines of `identity token`; calls must send `authorization: Bearer <token>` metadata.
    auth_tokens_file: str | None = None

    def __post_init__(self) -> None:
        check_types(self, "server.")

        def need(key: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"server.{key} = {getattr(self, key)!r}: must be {allowed}")

        need("host", valid_host(self.host), "an IP address or a host name, without a port (e.g. 127.0.0.1, ::1)")
        need("port", 0 <= self.port < 65536, "an integer in [0, 65535] (0 = any free port)")
        need(
            "metrics_port",
            self.metrics_port is None or 0 <= self.metrics_port < 65536,
            "null or an integer in [0, 65535]",
        )
        for key in ("max_waiting_requests", "max_prompt_chars", "max_requests_per_client"):
            need(key, getattr(self, key) >= 1, "an integer >= 1")
        need("max_queued_tokens_per_client", self.max_queued_tokens_per_client >= 2, "an integer >= 2")
        for key in ("max_prompt_tokens", "max_tokens_limit"):
            need(key, getattr(self, key) is None or getattr(self, key) >= 1, "null or an integer >= 1")
        need("drain_grace_seconds", self.drain_grace_seconds >= 0, "a number >= 0")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("server.tls_cert_file and server.tls_key_file: give both (TLS) or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("server.tls_client_ca_file: mutual TLS needs server.tls_cert_file and tls_key_file")
        for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
            path = getattr(self, key)
            need(key, path is None or Path(path).is_file(), "null or the path of a readable file")
        # gRPC says only "failed to bind" about a file that is not PEM: say which one it is.
        for key, marker in (
            ("tls_cert_file", b"-----BEGIN CERTIFICATE-----"),
            ("tls_client_ca_file", b"-----BEGIN CERTIFICATE-----"),
            ("tls_key_file", b"PRIVATE KEY-----"),
        ):
            path = getattr(self, key)
            need(
                key,
                path is None or marker in Path(path).read_bytes(),
                f"a PEM file holding a {marker.decode()!r} block",
            )

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
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = sorted(set(server) - names)
    if unknown:
        raise ConfigError(f"unknown server option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    return EngineConfig.from_options(**data), ServerConfig(**server)
