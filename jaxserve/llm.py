"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

All prompts are submitted at once and run with continuous batching and chunked prefill
through the same engine, KV pages and jitted step the server uses.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jaxserve.assembly import ChatMessages, EngineHandle, Prompt, assemble
from jaxserve.config import EngineConfig
from jaxserve.engine.request import Request
from jaxserve.errors import ConfigError, EngineError, RequestError
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "ChatMessages", "Prompt", "RequestOutput"]


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, a stop token or a stop string), "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    logprobs: list[float] | None = None  # of each generated token (when params.logprobs is set)
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _raise_if_failed(delta) -> None:
    if delta.error is not None:
        raise EngineError(delta.error)


def _output(r: Request) -> RequestOutput:
    want = r.params.logprobs is not None
    return RequestOutput(
        prompt_token_ids=r.prompt_token_ids,
        token_ids=r.output_token_ids,
        text=r.output_text,
        finish_reason=r.finish_reason or "abort",
        stop_reason=r.stop_reason,
        cumulative_logprob=float(sum(r.output_logprobs)),
        num_cached_tokens=r.num_cached_tokens,
        logprobs=list(r.output_logprobs) if want else None,
        top_logprobs=list(r.output_top_logprobs) if want else None,
    )


class LLM:
    """Loads a model (alias, Hugging Face directory or .gguf) and generates from it."""

    def __init__(
        self,
        model: str = EngineConfig.model,
        *,
        config: EngineConfig | None = None,
        progress: bool = True,
        keep_step_records: bool = False,
        **engine_options: Any,
    ):
        if config is not None and engine_options:
            raise ConfigError("give either config= or engine options, not both")
        self.config = config or EngineConfig.from_options(model=model, **engine_options)
        self.handle: EngineHandle = assemble(self.config, progress, keep_step_records)
        h = self.handle
        self.engine, self.tokenizer, self.model_config, self.plan = h.engine, h.tokenizer, h.model_config, h.plan
        # The parts, for tests and benchmarks that look inside.
        self.runner, self.scheduler, self.kv = h.engine.runner, h.engine.scheduler, h.engine.scheduler.kv
        self.max_model_len = h.max_model_len
        self.attention_backend = h.plan.backend

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text, token-id list or chat message list (template applied)."""
        return self.handle.encode(prompt)

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(p, (int, dict)) for p in prompts):
            return [prompts]
        return list(prompts)

    # -- generation ----------------------------------------------------------------
    def _check_length(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt with continuous batching; outputs in prompt order.

        On an LLM that is being served, the requests go through the server's engine thread
        (the one thread that steps the engine) and are batched with the server's traffic.
        """
        params = sampling_params or SamplingParams()
        encoded = [self.encode(p) for p in self._as_list(prompts)]
        for ids in encoded:
            self._check_length(ids)
        handoff = self.engine.handoff
        if handoff is not None:
            return [_output(s.request) for s in self._run_served(handoff, encoded, params)]
        with self.engine.owned_by_current_thread("an offline LLM.generate call"):
            requests = [self.engine.add_request(ids, params) for ids in encoded]
            try:
                while self.engine.has_unfinished():
                    self.engine.step()
            finally:
                self._end(requests)
        return [_output(r) for r in requests]

    def chat(
        self, conversations: ChatMessages | Sequence[ChatMessages], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of ``{"role", "content"}`` messages) or to each
        of several, through the model's chat template; outputs in order."""
        conversations = self._as_list(conversations)
        for i, c in enumerate(conversations):
            if not (isinstance(c, list) and c and all(isinstance(m, dict) for m in c)):
                raise RequestError(f"conversations[{i}] must be a non-empty list of {{role, content}} messages")
        return self.generate(conversations, sampling_params)

    def _end(self, requests: list[Request]) -> None:
        """Aborts what is unfinished (no-op for finished requests; frees pages on error) and,
        if a failed step took the donated KV cache, makes a fresh one for the next call."""
        for r in requests:
            self.engine.abort(r.request_id)
        if self.engine.runner.kv_cache_lost and not self.engine.has_unfinished():
            self.engine.recover()

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one completion as tokens are generated."""
        ids = self.encode(prompt)
        self._check_length(ids)
        params = sampling_params or SamplingParams()
        handoff = self.engine.handoff
        if handoff is not None:
            yield from (d.text for d in self._served_deltas(handoff, ids, params) if d.text)
            return
        with self.engine.owned_by_current_thread("an offline LLM.stream call"):
            request = self.engine.add_request(ids, params)
            sent = 0
            try:
                while not request.status.is_finished:
                    self.engine.step()
                    if len(request.output_text) > sent:
                        yield request.output_text[sent:]
                        sent = len(request.output_text)
            finally:
                self._end([request])

    # -- through a serving engine thread -------------------------------------------------
    def _run_served(self, handoff, encoded: list[list[int]], params: SamplingParams) -> list:
        """Submits every prompt to the engine thread, waits for all; returns the submissions."""
        subs = [
            handoff.submit_threadsafe(f"offline-{uuid.uuid4().hex}", ids, params, enforce_limit=False)
            for ids in encoded
        ]
        done = 0
        try:
            for sub in subs:
                while (delta := sub.deltas.get()).finish_reason is None:
                    pass
                _raise_if_failed(delta)
                done += 1
        finally:
            for sub in subs[done:]:  # interrupted or failed: free the rest
                if sub.request is not None:
                    handoff.abort(sub.request.request_id)
        return subs

    def _served_deltas(self, handoff, ids: list[int], params: SamplingParams) -> Iterator:
        request_id = f"offline-{uuid.uuid4().hex}"
        sub = handoff.submit_threadsafe(request_id, ids, params, enforce_limit=False)
        finished = False
        try:
            while True:
                delta = sub.deltas.get()
                _raise_if_failed(delta)
                yield delta
                if delta.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                handoff.abort(request_id)

    def stats(self) -> dict[str, int]:
        """Counters: steps, prefill_tokens_computed, decode_tokens, num_preemptions, num_compiles, pages_*."""
        return self.engine.stats()

    @property
    def platform(self) -> str:
        return jax.default_backend()
