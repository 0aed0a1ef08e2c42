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


def check_token_ids(ids, vocab_size: int, field: str) -> None:
    """Raises RequestError naming the first of ``ids`` outside the vocabulary (``field[i]``)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise RequestError(f"{field}[{i}] = {t}: out of range; allowed 0..{vocab_size - 1}")


def prompt_too_long(field: str, n: int, max_model_len: int) -> str:
    return f"{field}: {n} tokens; must be shorter than max_model_len ({max_model_len})"


def check_prompt_ids(ids, max_model_len: int, vocab_size: int | None, field: str = "prompt") -> None:
    """Raises RequestError unless ``ids`` is a prompt an engine can hold: not empty, shorter
    than max_model_len, every id in the vocabulary (its min and max first, at C speed: the
    walk that names a bad id only when there is one)."""
    if not ids:
        raise RequestError(f"{field}: the prompt is empty")
    if len(ids) >= max_model_len:
        raise RequestError(prompt_too_long(field, len(ids), max_model_len))
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        check_token_ids(ids, vocab_size, field)


def check_text(text: str, field: str) -> None:
    """Raises RequestError if ``text`` is not Unicode a tokenizer can take: a lone surrogate
    (``"\\ud800"``: Python strings may hold one, UTF-8 cannot) was a TypeError from deep
    inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"{field}: not valid Unicode text: a lone surrogate {text[e.start]!r} at character {e.start}"
        ) from None
