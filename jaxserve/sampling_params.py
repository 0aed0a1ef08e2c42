"""Per-request sampling parameters (plain Python; validated on construction)."""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxserve.errors import RequestError, check_text

MAX_STOP_TOKEN_IDS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_N = 64  # samples of one prompt
MAX_GRAMMAR_CHARS = 100_000  # a JSON schema, regex or Lark grammar
MAX_LOGIT_BIAS = 300  # biased token ids per request (OpenAI's limit)
MAX_CHOICES = 256
# Below this a temperature divides logits past float32's range; 0 asks for greedy plainly.
MIN_TEMPERATURE = 0.01


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _items(value):
    """A list field as a tuple (a lone string as one item); anything not iterable as it is,
    for its check to name."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        return value


def _shown(value) -> str:
    """A value for an error message, cut short: errors travel as gRPC metadata (8 KiB)."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` (or vLLM's -1, taken as 0) and
    ``top_p == 1`` disable those filters. A request with a ``seed`` gives the same tokens
    whatever else is batched.
    """

    max_tokens: int = 16  # 0: prefill only (the prompt's K/V computed and cached, no token)
    # Samples of the prompt, computed once: the other samples fork from the first in the
    # step that finishes it (their first token drawn from its last logits row; pages shared,
    # the last one copied), or, when a fork is not possible, reuse it from the prefix cache.
    # With a seed, sample i draws with its own seed derived from it (sample 0: the seed).
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Added to the logits of these token ids before sampling, (token id, bias) pairs in
    # [-100, 100] (a dict is taken too); -100 all but bans a token, 100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # also return the top-n logprobs at each position (n <= 20)
    # Also return each prompt token's logprob given the tokens before it, and the top-n
    # there (n <= 20; 0: the token's own only). The prompt is then computed whole (no
    # prefix-cache hit), and its steps are not overlapped with the host's work.
    prompt_logprobs: int | None = None
    # Prompt logprobs from this token on only: those before it are None and may come from
    # the prefix cache (scoring continuations of a cached prefix: lang's select).
    prompt_logprobs_start: int = 0
    stop: tuple[str, ...] = ()  # stop strings, matched across token boundaries
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output (at most one): the output is a JSON document valid under this JSON
    # schema (its JSON text), any JSON object, a full match of this regex, exactly one of
    # these strings, or a sentence of this Lark grammar (llguidance's dialect). The request
    # ends when the constraint is met and nothing more may follow.
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if _int(self.top_k) and self.top_k == -1:  # vLLM's "every token" (its default once)
            object.__setattr__(self, "top_k", 0)
        for name in ("stop", "stop_token_ids") + (("choice",) if self.choice is not None else ()):
            object.__setattr__(self, name, _items(getattr(self, name)))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            bias = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise RequestError(
                f"sampling_params.logit_bias = {_shown(self.logit_bias)}: must be (token id, bias) pairs"
            ) from None
        object.__setattr__(self, "logit_bias", bias)
        checks = [
            (
                "max_tokens",
                _int(self.max_tokens) and self.max_tokens >= 0,
                "an integer >= 0 (0: prefill only, the prompt goes to the prefix cache)",
            ),
            (
                "n",
                _int(self.n) and 1 <= self.n <= MAX_N,
                f"an integer in [1, {MAX_N}]",
            ),
            (
                "temperature",
                _number(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
                f"a number >= 0: 0 (greedy) or at least {MIN_TEMPERATURE}",
            ),
            (
                "top_k",  # the sampler's int32: 10**12 failed the step, every request in it
                _int(self.top_k) and 0 <= self.top_k < 2**31,
                "an integer in [-1, 2**31) (0 or -1: disabled)",
            ),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", _number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            (
                "seed",
                self.seed is None or (_int(self.seed) and 0 <= self.seed < 2**63),
                "None or an integer in [0, 2**63)",
            ),
            (
                "min_tokens",
                # (a bad max_tokens failed its own check above)
                _int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens if _int(self.max_tokens) else 0),
                "an integer in [0, max_tokens]",
            ),
            (
                "stop_token_ids",
                isinstance(self.stop_token_ids, tuple)
                and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                and all(_int(t) and t >= 0 for t in self.stop_token_ids),
                f"at most {MAX_STOP_TOKEN_IDS} non-negative token ids",
            ),
            (
                "repetition_penalty",
                _number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
                "a number in (0, 10] (1 = off)",
            ),
            (
                "presence_penalty",
                _number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "a number in [-2, 2]",
            ),
            (
                "frequency_penalty",
                _number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "a number in [-2, 2]",
            ),
            (
                "logprobs",
                self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= 20),
                "None or an integer in [0, 20]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or (_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
                "None or an integer in [0, 20]",
            ),
            (
                "prompt_logprobs_start",
                _int(self.prompt_logprobs_start) and self.prompt_logprobs_start >= 0,
                "an integer >= 0",
            ),
            (
                "stop",
                isinstance(self.stop, tuple)
                and len(self.stop) <= MAX_STOP_STRINGS
                and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_STRING_LEN for x in self.stop),
                f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_LEN} characters",
            ),
        ]
        text = "a non-empty string of at most {} characters"
        for name, limit in (
            ("json_schema", MAX_GRAMMAR_CHARS),
            ("regex", MAX_GRAMMAR_CHARS),
            ("grammar", MAX_GRAMMAR_CHARS),
        ):
            value = getattr(self, name)
            checks.append(
                (name, value is None or (isinstance(value, str) and 0 < len(value) <= limit), text.format(limit))
            )
        for name in ("json_object", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            checks.append((name, isinstance(getattr(self, name), bool), "true or false"))
        checks.append(
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(_int(t) and t >= 0 for t, _ in self.logit_bias)
                and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
                f"at most {MAX_LOGIT_BIAS} distinct token ids (integers >= 0), each with a bias in [-100, 100]",
            )
        )
        checks.append(
            (
                "choice",
                self.choice is None
                or (
                    isinstance(self.choice, tuple)
                    and 0 < len(self.choice) <= MAX_CHOICES
                    and all(isinstance(c, str) and 0 < len(c) <= MAX_STOP_STRING_LEN for c in self.choice)
                ),
                f"None or 1 to {MAX_CHOICES} non-empty strings of at most {MAX_STOP_STRING_LEN} characters",
            )
        )
        for field, ok, allowed in checks:
            if not ok:
                raise RequestError(f"sampling_params.{field} = {_shown(getattr(self, field))}: must be {allowed}")
        for t, b in self.logit_bias:  # the entry at fault, not the whole (up to 300-entry) map
            if not (_number(b) and -100 <= b <= 100):
                raise RequestError(
                    f"sampling_params.logit_bias: token {t}'s bias {b!r}: must be a number in [-100, 100]"
                )
        # Text the grammar compiler or the stop matcher takes as UTF-8: a lone surrogate (a
        # Python str can hold one) was UnicodeEncodeError from inside llguidance.
        for name in ("json_schema", "regex", "grammar"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), f"sampling_params.{name}")
        for name in ("stop", "choice"):
            for i, item in enumerate(getattr(self, name) or ()):
                check_text(item, f"sampling_params.{name}[{i}]")
        given = [k for k in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(self, k)]
        if len(given) > 1:
            raise RequestError(
                f"sampling_params.{given[1]}: only one structured-output constraint per request; "
                f"{' and '.join(given)} are set"
            )

    def samples(self) -> list[SamplingParams]:
        """One SamplingParams per sample (n of them, each n = 1): sample i's seed is derived
        from the seed (sample 0 keeps it), so seeded samples differ from one another."""
        if self.n == 1:
            return [self]
        seeds = [None if self.seed is None else (self.seed + i * 0x9E3779B97F4A7C15) % 2**63 for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]

    @property
    def is_constrained(self) -> bool:
        """Structured output: one of json_schema, json_object, regex, choice, grammar."""
        return bool(self.json_schema or self.json_object or self.regex or self.choice or self.grammar)

    @property
    def has_penalties(self) -> bool:
        """Penalties or a logit bias: the sampler's variant that takes them."""
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or bool(self.logit_bias)
        )


# vLLM's SamplingParams fields that scripts ported from it pass, and what stands for each
# here: the refusal of one says so.
VLLM_FIELDS = {
    "structured_outputs": "structured output is json_schema, json_object, regex, choice or grammar",
    "guided_decoding": "structured output is json_schema, json_object, regex, choice or grammar",
    "prompt_logprob_start": "the first scored prompt token is prompt_logprobs_start",
    "detokenize": "the output is always detokenized (token_ids has the ids)",
    "output_kind": "LLM.stream gives deltas, generate whole outputs",
    "truncate_prompt_tokens": "a request's own field over HTTP and gRPC; offline, pass the ids' tail (llm.get_tokenizer().encode(p)[-k:])",
}


def _refuse_unknown_fields(init):
    """The generated ``__init__`` behind one RequestError for an unknown keyword (Python's
    TypeError named it, but not what is allowed)."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - names)
        if unknown:
            vllm = "".join(f"{k} is vLLM's: {VLLM_FIELDS[k]}; " for k in unknown if k in VLLM_FIELDS)
            raise RequestError(
                f"sampling_params: unknown field(s) {', '.join(unknown)}; {vllm}allowed: {', '.join(sorted(names))}"
            )
        init(self, *args, **kwargs)

    return checked


SamplingParams.__init__ = _refuse_unknown_fields(SamplingParams.__init__)
