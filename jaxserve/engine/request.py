"""One request's state as the scheduler sees it (plain Python).

Token regions of a request (``num_tokens = len(prompt) + len(output)``)::

    |<------------- all_token_ids ------------->|
    |<--- num_computed_tokens --->|             |   K/V already in the request's pages
                                  |<- to go  ->|   next steps compute these (a prefill
                                                    chunk, or 1 token when decoding)

Status: WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (pages freed, computed
reset to 0) -> RUNNING again, recomputing prompt + output so far.
"""

from __future__ import annotations

import dataclasses
import enum

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
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + params.stop_token_ids
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
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
    output_text: str = ""  # text emitted so far (never a partial character or a possible stop)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    client: str = ""  # who asked (server: identity or peer); fair admission shares slots by it

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        """True once only the newest sampled token is left to compute (decoding)."""
        return self.num_tokens_to_compute <= 1 and bool(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
