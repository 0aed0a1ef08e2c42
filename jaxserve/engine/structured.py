"""Structured output: JSON schema, any JSON object, regex, a list of choices, or a Lark
grammar, enforced token by token with llguidance.

Why llguidance (over xgrammar and outlines-core): it needs no torch (the server never
imports it), computes a token mask in tens of microseconds with no per-grammar
precompilation over the vocabulary (a new JSON schema costs nothing up front, which a
server taking arbitrary schemas needs), speaks JSON schema, regex and Lark, and is what
vLLM's and llama.cpp's guidance backends use.

The host keeps one matcher per constrained request (``Constraint``): before a step, the
allowed-token bitmask of each constrained row (``fill``); after it, the sampled token
advances the matcher (``advance``), and a grammar that has accepted with nothing allowed
after ends the request ("stop"); one that failed (its lexer's limits) ends it too, as
"abort": its output does not satisfy the constraint. The bitmask goes to the jitted
sampler as a fixed-shape input (nothing recompiles); steps without a constrained request
pass an all-ones mask kept on the device, and the sampler skips the masking for them
(``lax.cond``). Each grammar is compiled once, on the thread that checks the request,
and copied per request.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from jaxserve.errors import RequestError
from jaxserve.sampling_params import SamplingParams

_ANY_OBJECT = '{"type": "object"}'
# JSON as people write it on one line ('{"a": 1, "b": [2, 3]}'), and no other whitespace:
# with free whitespace a model can pad a document with newlines until max_tokens (a known
# failure of flexible JSON grammars). A schema's own "x-guidance" options override this.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask: bit j of word w allows token 32 w + j."""
    return (vocab_size + 31) // 32


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


# Grammars whose check is remembered: at most this many, and this many characters.
MAX_CHECKED, MAX_CHECKED_CHARS = 1024, 8_000_000
# Compiled matchers kept for copying (~0.1 MB for a small schema, ~3 MB for a
# 1000-property one over SmolLM2's vocabulary, once its first mask is made).
MAX_READY_MATCHERS = 64


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary. Thread-safe: front ends validate on their
    worker threads, which also compile each grammar's matcher; the engine thread copies
    one per request (``constraint``)."""

    def __init__(self, tokenizer, vocab_size: int | None, eos_token_ids: set[int]):
        """``vocab_size``: the model's (its logits' width; None: the tokenizer's)."""
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's view of it, built on first use (~0.3 s)
        self._lock = threading.Lock()
        self._checked: dict[str, str] = {}  # grammar -> "" (valid) or the error, oldest first
        self._checked_chars = 0  # their length: 1024 grammars of 100k characters would hold 100 MB
        self._ready: dict[str, object] = {}  # grammar -> its LLMatcher at the start, least recently used first

    @property
    def vocab_size(self) -> int:
        return self._vocab_size if self._vocab_size is not None else len(self._hf)

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                eos = self._eos or None
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    @staticmethod
    def grammar_of(params: SamplingParams) -> tuple[str, str] | None:
        """(the field that constrains, llguidance's grammar), or None."""
        from llguidance import LLMatcher

        if params.json_schema is not None:
            try:
                return "json_schema", LLMatcher.grammar_from_json_schema(params.json_schema, defaults=_JSON_STYLE)
            except ValueError as e:
                raise RequestError(f"sampling_params.json_schema: not a JSON schema: {str(e)[:300]}") from None
        if params.json_object:
            return "json_object", LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_STYLE)
        if params.regex is not None:
            return "regex", LLMatcher.grammar_from_regex(params.regex)
        if params.choice:
            return "choice", LLMatcher.grammar_from_lark("start: " + " | ".join(map(_lark_string, params.choice)))
        if params.grammar is not None:
            return "grammar", LLMatcher.grammar_from_lark(params.grammar)
        return None

    def check(self, params: SamplingParams) -> str | None:
        """The request's grammar, validated (None: unconstrained). Raises RequestError
        naming the field and what is wrong, before any compute."""
        found = self.grammar_of(params)
        if found is None:
            return None
        field, grammar = found
        error = self._checked.get(grammar)
        if error is None:
            from llguidance import LLMatcher

            error = LLMatcher.validate_grammar(grammar, self._llg_tokenizer())
            if not error or error.startswith("WARNING"):
                error = self._first_mask_error(grammar) or error
            with self._lock:
                if grammar not in self._checked:
                    self._checked_chars += len(grammar)
                self._checked[grammar] = error
                while len(self._checked) > MAX_CHECKED or self._checked_chars > MAX_CHECKED_CHARS:
                    self._checked_chars -= len(oldest := next(iter(self._checked)))
                    del self._checked[oldest]
        if error and not error.startswith("WARNING"):
            raise RequestError(f"sampling_params.{field}: {error[:500]}")
        self._ready_matcher(grammar)  # compiled here (again, if it has left the cache), not on the engine thread
        return grammar

    def _first_mask_error(self, grammar: str) -> str:
        """The error of the grammar's first token mask, or "". A grammar can be valid and
        still exceed llguidance's lexer limits once it meets the vocabulary: on SmolLM2's
        49k tokens "(.{0,500}){0,500}" fails there ("too many expressions constructed").
        Met here (~ms, on the front end's worker, once per grammar), it is a refusal
        naming the field; met mid-way, it ends the request ("abort", see Scheduler)."""
        matcher = self._ready_matcher(grammar)
        if not matcher.is_error():
            return ""
        error = matcher.get_error().split("\n", 1)[0]
        if error.startswith("lexer error"):
            return f"too complex to enforce over this vocabulary (llguidance: {error})"
        return f"no output can satisfy it (llguidance: {error})"  # e.g. NoExtensionBias: "start: start"

    def _ready_matcher(self, grammar: str):
        """The grammar's matcher at its start, its first mask made (its lexer's first states
        built), for ``constraint`` to copy. Copying takes ~10 us; compiling anew took ~80 ms
        for a 1500-property JSON schema over SmolLM2's vocabulary (~0.3 s on a busy 2-core
        machine), which on the engine thread stalled every stream, once per request."""
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._ready.pop(grammar, None)
            if matcher is not None:
                self._ready[grammar] = matcher  # most recently used last
                return matcher
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        Constraint(matcher, bitmask_words(self.vocab_size)).fill(np.empty(bitmask_words(self.vocab_size), np.int32))
        if not matcher.is_error():  # (never stored once in error, nothing copies it)
            with self._lock:
                self._ready[grammar] = matcher
                while len(self._ready) > MAX_READY_MATCHERS:
                    self._ready.pop(next(iter(self._ready)))
        return matcher

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes: for a piece of a multi-byte character, that piece (what
        the tokenizer's decode shows as U+FFFD), so pieces joined give the character."""
        if token_id >= len(self._hf):  # a row of the model's past its tokenizer's vocabulary
            return b""  # decodes to "" (llguidance would name it "<[id]>")
        return self._llg_tokenizer().decode_bytes([token_id])

    def constraint(self, grammar: str) -> Constraint:
        """A request's own matcher: a copy of the grammar's compiled one (``check`` made it
        on the front end's thread; compiled here only if it has left the cache since)."""
        return Constraint(self._ready_matcher(grammar).deep_copy(), bitmask_words(self.vocab_size))

    def fill(self, constraints: list[Constraint]) -> np.ndarray:
        """Each constraint's next-token bitmask, a row each (int32 [n, words]). One after
        another: ~2-5 us a mask for a simple regex over SmolLM2's 49k tokens, where
        llguidance's thread pool (LLExecutor) cost ~0.4 ms a step in hand-offs."""
        masks = np.empty((len(constraints), bitmask_words(self.vocab_size)), np.int32)
        for c, row in zip(constraints, masks, strict=True):
            c.fill(row)
        return masks


class Constraint:
    """One request's grammar state: what may come next, advanced by each sampled token."""

    def __init__(self, matcher, words: int):
        self._matcher = matcher
        self.words = words

    def fill(self, row: np.ndarray) -> None:
        """The allowed-token bitmask for the next token into ``row`` (int32 [words])."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """Accepted, and nothing but the end may follow (or the grammar failed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""
