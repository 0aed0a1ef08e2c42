"""Errors jaxserve raises on bad input; each message names the problem and what is allowed."""

from __future__ import annotations


class JaxServeError(Exception):
    """Base class for errors caused by the user's input or files, not by a bug."""


class ModelLoadError(JaxServeError):
    """A model path, config or weight file that jaxserve cannot load."""


class ConfigError(JaxServeError):
    """A configuration key with a missing or invalid value."""


class RequestError(JaxServeError):
    """A request (prompt or sampling parameters) that cannot be served."""


class EngineError(JaxServeError):
    """The engine failed while running a request (a failed step, a failed warm-up)."""
