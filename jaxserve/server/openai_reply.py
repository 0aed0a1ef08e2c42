"""The pieces of an OpenAI answer that the engine's deltas become: each token's text and
bytes, logprobs in the completion, chat and vLLM prompt shapes, usage, vLLM's stop_reason,
choices joined for a whole response, and server-sent events for a stream.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import AsyncIterator

from jaxserve.assembly import EngineHandle
from jaxserve.engine.async_engine import Delta
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.openai_protocol import APIError


class ReplyFormatter:
    """Formats one server's answers; caches its tokenizer's token texts."""

    def __init__(self, handle: EngineHandle):
        self.handle = handle

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per server, as long-lived as it
    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.handle.token_bytes(token_id))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - as token_bytes
    def token_text(self, token_id: int) -> str:
        # From the token's own bytes, not the tokenizer's decode of it alone: a SentencePiece
        # tokenizer's (Llama 2, Mistral) drops a lone token's leading space ("▁Paris" ->
        # "Paris"), and then the tokens no longer add up to the text.
        return bytes(self.token_bytes(token_id)).decode("utf-8", errors="replace")

    def stop_reason(self, reason: int | str | None, params: SamplingParams) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop token id that ended the output, None
        for the tokenizer's end-of-sequence token (the engine's own reason names it too)."""
        if not params.ignore_eos and reason == self.handle.tokenizer.eos_token_id:
            return None
        return reason

    def completion_logprobs(self, ids: list[int], lps: list[float], tops, offset: int) -> dict:
        """/v1/completions' shape; ``offset``: the first token's place in the choice's text."""
        tokens = [self.token_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [None if top is None else {self.token_text(t): lp for t, lp in top} for top in tops],
            "text_offset": offsets,
        }

    def chat_logprobs(self, ids: list[int], lps: list[float], tops) -> dict:
        """``tops`` is empty when no top_logprobs were asked (the engine lists top-n only
        for n > 0): each token's is then [], as OpenAI's (a strict zip of them was a
        ValueError: every chat with logprobs = true alone failed)."""
        tops = tops or [[] for _ in ids]

        def entry(t, lp):
            text = self.token_text(t)
            # The token's own bytes, as OpenAI's: a piece of a character shows as U+FFFD in
            # `token` (as vLLM's), and the pieces' bytes joined give the character.
            return {"token": text, "logprob": lp, "bytes": self.token_bytes(t)}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                for t, lp, top in zip(ids, lps, tops, strict=True)
            ]
        }

    def prompt_logprobs(self, ids: list[int], delta: Delta) -> list | None:
        """vLLM's shape: None for the first token, then {token id: {logprob, decoded_token}}."""
        if delta.prompt_logprobs is None:
            return None
        out = []
        for t, lp, top in zip(ids, delta.prompt_logprobs, delta.prompt_top_logprobs, strict=True):
            if lp is None:
                out.append(None)
                continue
            entries = {t: lp, **{a: b for a, b in top or ()}}
            out.append({str(a): {"logprob": b, "decoded_token": self.token_text(a)} for a, b in entries.items()})
        return out


def usage(finals: dict[int, Delta], n: int) -> dict:
    """Prompt and cached tokens once per prompt (its first sample), output of all."""
    firsts = [d for i, d in finals.items() if i % n == 0]
    prompt = sum(d.prompt_tokens for d in firsts)
    completion = sum(d.completion_tokens for d in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)},
    }


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """vLLM's ``continuous_usage_stats``: a streamed chunk's choice's counts so far."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclasses.dataclass
class Gathered:
    """One choice's deltas, joined."""

    # Its text in the pieces it came in: adding each to one string would copy the text so
    # far every step, on the event loop (~15 us a step at 128 KB of output).
    pieces: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    final: Delta | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def gather(deltas: AsyncIterator[tuple[int, Delta]], n: int) -> list[Gathered]:
    """Every delta of ``n`` choices, joined per choice (a non-streaming answer)."""
    out = [Gathered() for _ in range(n)]
    async for i, d in deltas:
        c = out[i]
        c.pieces.append(d.text)
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        c.top_logprobs += d.top_logprobs
        if d.finish_reason is not None:
            c.final = d
    return out


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then ``[DONE]``; an engine error mid-stream ends it with an error event
    (the status line has gone out already)."""
    try:
        async for chunk in events:
            yield chunk
    except APIError as e:
        yield event(e.body())
    yield "data: [DONE]\n\n"
