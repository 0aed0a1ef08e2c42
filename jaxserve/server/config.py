"""`jaxserve run` configuration: engine options at the top level of the YAML file plus a
``server:`` section. Unknown keys and bad values are rejected at start-up, by name."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import EngineConfig, read_config_file
from jaxserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 9090  # Prometheus text format over HTTP; None = off
    max_waiting_requests: int = 256  # beyond this, new requests get RESOURCE_EXHAUSTED
    drain_grace_seconds: float = 30.0  # SIGTERM: let in-flight requests finish this long
    warmup: bool = True  # compile every bucket before reporting SERVING

    def __post_init__(self) -> None:
        def need(key: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"server.{key} = {getattr(self, key)!r}: must be {allowed}")

        def port_ok(v) -> bool:
            return isinstance(v, int) and 0 <= v < 65536

        need("host", isinstance(self.host, str) and bool(self.host), "a host name or address")
        need("port", port_ok(self.port), "an integer in [0, 65535] (0 = any free port)")
        need(
            "metrics_port", self.metrics_port is None or port_ok(self.metrics_port), "null or an integer in [0, 65535]"
        )
        need(
            "max_waiting_requests",
            isinstance(self.max_waiting_requests, int) and self.max_waiting_requests >= 1,
            "an integer >= 1",
        )
        need(
            "drain_grace_seconds",
            isinstance(self.drain_grace_seconds, (int, float)) and self.drain_grace_seconds >= 0,
            "a number >= 0",
        )
        need("warmup", isinstance(self.warmup, bool), "true or false")


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
