"""One request's state as the scheduler sees it (plain Python).

Token regions of a request: one append-only list, ``token_ids`` (the prompt, then each
sampled token as the scheduler appends it)::

    |<--------------- token_ids --------------->|
    |<--- num_computed_tokens --->|             |   K/V already in the request's pages
                                  |<- to go  ->|   next steps compute these (a prefill
                                                    chunk, or 1 token when decoding)

With overlap scheduling the scheduler runs one step ahead of the tokens: a step in
flight will give the request a token whose value the host does not know yet. It is
counted in ``num_pending`` (not in ``token_ids``, which users read), so the positions
the scheduler reasons about (``num_tokens``, ``num_sampled``) include it, while the
user-facing counts (``output_token_ids``, ``num_output_tokens``) do not.

Status: WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (pages freed, computed
reset to 0) -> RUNNING again, recomputing prompt + output so far.

The scheduler writes status and tokens, the KV manager ``pages``, ``num_computed_tokens``
and the cache fields, the output stage ``output_chunks`` and the logprob lists.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # given the prompt; sampled tokens are appended (never rewritten)
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + params.stop_token_ids
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # [(token id, logprob)] top-n alternatives per output token, when params.logprobs
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission
    cache_node: object = None  # the radix node this request holds locked (prefix cache)
    arrival: int = 0  # scheduler step at which it arrived (lpm aging)
    # Text emitted so far (never a partial character or a possible stop), in the pieces it
    # came in: appending to one string copies it whole, ~15 us a token at 128 KB of output.
    output_chunks: list[str] = dataclasses.field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_pending: int = 0  # tokens a step in flight will give it (0 or 1; overlap scheduling)
    client: str = ""  # who asked (server: identity or peer); fair admission shares slots by it
    pin_s: float | None = None  # when it finishes, pin its cached tokens for this long (a lease)
    lease_id: str | None = None  # the lease that pin made
    pin_refused: str = ""  # or why it made none
    # Prompt logprobs (params.prompt_logprobs): of prompt token i given those before it, one
    # per prompt token, None for token 0 and before params.prompt_logprobs_start (those may
    # come from the cache) until the step scoring it ran.
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(default_factory=list)
    # Structured output: the grammar state (engine/structured.py's Constraint), advanced
    # by every sampled token; None when unconstrained.
    constraint: Any = None
    # Penalties: token_ids as the step's input takes them (runner/step.py's TokenHistory),
    # grown each step by the new ids; None until the request's first penalised step.
    history: Any = None
    num_prompt_tokens: int = dataclasses.field(init=False)  # len(token_ids) as given

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
            self.prompt_top_logprobs = [None] * self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_text(self) -> str:
        return "".join(self.output_chunks)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, the one a step in flight will give included."""
        return self.num_output_tokens + self.num_pending

    @property
    def num_tokens(self) -> int:
        """Prompt + output positions, the pending one included (what the scheduler plans over)."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        """True once only the newest sampled token is left to compute (decoding)."""
        return self.num_tokens_to_compute <= 1 and self.num_sampled > 0

    @property
    def scores_prompt(self) -> bool:
        """Its rows this step score prompt tokens: it asked for prompt logprobs and is not
        decoding a token still in flight."""
        return self.params.prompt_logprobs is not None and not self.num_pending

    @property
    def score_from(self) -> int:
        """The first prompt token whose logprob is wanted (params.prompt_logprobs)."""
        return max(1, self.params.prompt_logprobs_start)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
