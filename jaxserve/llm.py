"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

All prompts are submitted at once and run with continuous batching and chunked prefill
through the same engine, KV pages and jitted step the server uses.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxserve.assembly import ChatMessages, EngineHandle, Prompt, assemble
from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import EngineStoppedError
from jaxserve.engine.request import Request
from jaxserve.errors import ConfigError, EngineError, RequestError
from jaxserve.sampling_params import SamplingParams

ONE_PROMPT = (
    "one prompt (a string, a list of token ids, a list of chat messages, or vLLM's "
    '{"prompt": text} / {"prompt_token_ids": ids})'
)
# vLLM's TextPrompt and TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids}, the
# latter with the text they came from beside them if the caller has it.
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")

__all__ = ["LLM", "ChatMessages", "PinnedPrefix", "Prompt", "RequestOutput"]


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, a stop token or a stop string), "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    cumulative_logprob: float | None = None  # when params.logprobs is set, as in vLLM
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    logprobs: list[float] | None = None  # of each generated token (when params.logprobs is set)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # When params.prompt_logprobs is set: each prompt token's logprob given those before it
    # (None for the first, and before params.prompt_logprobs_start), and its top-n.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    samples: list[RequestOutput] | None = None  # n > 1: every sample (this object is sample 0's)
    # The prompt's text (vLLM's): as given, or a chat's rendering by the template; None for
    # token ids given without it.
    prompt: str | None = None
    index: int = 0  # which sample of its prompt this is (vLLM's CompletionOutput.index)

    @property
    def outputs(self) -> list[RequestOutput]:
        """Every sample, in vLLM's shape (its ``output.outputs[0].text`` is this ``text``)."""
        return self.samples or [self]


@dataclasses.dataclass
class PinnedPrefix:
    """A prompt computed and pinned in the prefix cache (``LLM.pin``) until ``LLM.unpin`` or
    ``ttl_s`` seconds pass."""

    lease_id: str
    num_tokens: int  # the prompt's tokens, all pinned
    num_cached_tokens: int  # of which were cached already (not computed by the pin)


def _output(r: Request) -> RequestOutput:
    want = r.params.logprobs is not None
    return RequestOutput(
        prompt_token_ids=r.prompt_token_ids,
        token_ids=r.output_token_ids,
        text=r.output_text,
        finish_reason=r.finish_reason or "abort",
        stop_reason=r.stop_reason,
        cumulative_logprob=float(sum(r.output_logprobs)) if want else None,
        num_cached_tokens=r.num_cached_tokens,
        logprobs=list(r.output_logprobs) if want else None,
        top_logprobs=list(r.output_top_logprobs) if want else None,
        prompt_logprobs=list(r.prompt_logprobs) if r.params.prompt_logprobs is not None else None,
        prompt_top_logprobs=list(r.prompt_top_logprobs) if r.params.prompt_logprobs is not None else None,
    )


def _engine_config(config: EngineConfig | str | os.PathLike | None, options: dict[str, Any]) -> EngineConfig:
    if config is None:
        return EngineConfig.from_options(**options)
    if isinstance(config, (str, os.PathLike)):
        return EngineConfig.from_file(os.fspath(config), **options)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config: an EngineConfig or a YAML file's path; got a {type(config).__name__}")
    if options:
        raise ConfigError(
            f"config: an EngineConfig takes no engine options beside it (got {', '.join(sorted(options))}): "
            "set them in it (dataclasses.replace), or give config as a YAML file's path"
        )
    return config


def _is_prompt_dict(p: Any) -> bool:
    """vLLM's prompt dicts, told from a chat message (which has a role)."""
    return isinstance(p, dict) and "role" not in p and any(k in p for k in PROMPT_DICT_KEYS)


class LLM:
    """Loads a model (alias, Hugging Face directory or .gguf) and generates from it."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | str | os.PathLike | None = None,
        progress: bool = True,
        warmup: bool = True,
        **engine_options: Any,
    ):
        """``model`` and ``engine_options``: docs/configuration.md (``model`` defaults to
        SmolLM2). ``config``: an EngineConfig, or a YAML file as ``jaxserve run --config``
        takes, whose engine options ``model`` and ``engine_options`` then override, as
        ``--set`` does. ``warmup``: compile (or load from the compile cache) every step
        bucket now, so the first ``generate`` runs as fast as later ones; off, each
        compiles on first use."""
        if model is not None:
            engine_options["model"] = model
        self.config = _engine_config(config, engine_options)
        self.handle: EngineHandle = assemble(self.config, progress, warmup=warmup)
        h = self.handle
        self.engine, self.tokenizer, self.model_config, self.plan = h.engine, h.tokenizer, h.model_config, h.plan
        # The parts, for tests and benchmarks that look inside.
        self.runner, self.scheduler, self.kv = h.engine.runner, h.engine.scheduler, h.engine.scheduler.kv
        self.max_model_len = h.max_model_len
        self.attention_backend = h.plan.backend
        if warmup:
            self.runner.warmup(progress)

    def encode(self, prompt: Prompt | dict) -> list[int]:
        """Token ids of a text, token-id list or chat message list (template applied), or of
        vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``; shorter than max_model_len."""
        return self._encode_with_text(prompt)[0]

    def _encode_with_text(self, prompt: Prompt | dict, field: str = "prompt", **chat) -> tuple[list[int], str | None]:
        if not isinstance(prompt, dict):
            return self.handle.encode_with_text(prompt, field, **chat)
        unknown = sorted(map(str, set(prompt) - set(PROMPT_DICT_KEYS)))
        if unknown or not prompt:
            raise RequestError(
                f"{field}: a prompt dict (vLLM's TextPrompt / TokensPrompt) takes 'prompt' (a string) and / or "
                f"'prompt_token_ids' (a list of token ids); got {unknown or 'neither'}"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise RequestError(f"{field}.prompt: a string; got a {type(text).__name__}")
        if "prompt_token_ids" not in prompt:
            return self.handle.encode_with_text(text, f"{field}.prompt")
        ids = prompt["prompt_token_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise RequestError(f"{field}.prompt_token_ids: a non-empty list of token ids (integers)")
        return self.handle.encode_with_text(ids, f"{field}.prompt_token_ids")[0], text

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt], what: str = "prompts") -> list[Prompt]:
        one = "one conversation (a list of chat messages)" if what == "messages" else ONE_PROMPT
        # a lone dict with no role is read as vLLM's prompt dict: its refusal names its keys
        if isinstance(prompts, str) or (what == "prompts" and isinstance(prompts, dict) and "role" not in prompts):
            return [prompts]
        if (
            isinstance(prompts, list)
            and prompts
            and all(isinstance(p, (int, dict)) for p in prompts)
            and not (what == "prompts" and all(map(_is_prompt_dict, prompts)))
        ):
            return [prompts]
        # a lone message (a dict) would list its keys as prompts: "role", "content"
        if isinstance(prompts, (dict, bytes)) or not hasattr(prompts, "__iter__"):
            raise RequestError(f"{what}: {one} or a list of them; got a {type(prompts).__name__}")
        return list(prompts)

    # -- generation ----------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt with continuous batching; outputs in prompt order.
        A prompt: a string, token ids, chat messages, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``. ``sampling_params``: one for all, or a list with one per prompt (as vLLM's).
        ``use_tqdm``: a progress bar of the requests finished (vLLM's argument; off by default).

        On an LLM that is being served, the requests go through the server's engine thread
        (the one thread that steps the engine) and are batched with the server's traffic.
        """
        return self._generate(self._as_list(prompts), sampling_params, use_tqdm, "prompts")

    def _generate(
        self, prompts: list[Prompt], sampling_params, use_tqdm: bool, what: str, chat: dict | None = None
    ) -> list[RequestOutput]:
        """``generate`` of a list of prompts; refusals name ``what[i]``; ``chat``: how a
        conversation ends (``EngineHandle.encode``)."""
        encoded = [self._encode_with_text(p, f"{what}[{i}]", **(chat or {})) for i, p in enumerate(prompts)]
        params = self._params_per_prompt(sampling_params, len(encoded))
        # n > 1: one request per sample, all at once (the scheduler computes their shared
        # prompt once: the others fork from the first when it finishes the prompt).
        flat = [(ids, sp) for (ids, _), p in zip(encoded, params, strict=True) for sp in p.samples()]
        with tqdm(total=len(flat), desc="requests", unit="req", disable=not use_tqdm) as bar:
            if self.engine.handoff is not None:
                outs = []
                for sub, delta in self._served([ids for ids, _ in flat], [sp for _, sp in flat]):
                    if delta.finish_reason:
                        outs.append(_output(sub.request))
                        bar.update()  # in prompt order: a later request's end shows when those before it ended
            else:
                with self.engine.owned_by_current_thread("an offline LLM.generate call"):
                    requests = [self.engine.add_request(ids, sp) for ids, sp in flat]
                    for _ in self._steps(requests):
                        if use_tqdm:
                            bar.update(sum(r.status.is_finished for r in requests) - bar.n)
                outs = [_output(r) for r in requests]
            bar.update(len(flat) - bar.n)
        grouped, i = [], 0
        for (_, text), p in zip(encoded, params, strict=True):
            samples, i = outs[i : i + p.n], i + p.n
            for index, sample in enumerate(samples):
                sample.prompt, sample.index = text, index
            grouped.append(dataclasses.replace(samples[0], samples=samples) if p.n > 1 else samples[0])
        return grouped

    @staticmethod
    def _params_per_prompt(params, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if not isinstance(params, (list, tuple)):  # a dict would list its keys as the "items"
            raise RequestError(
                f"sampling_params: one SamplingParams, or a list of {n} (one per prompt); got a {type(params).__name__}"
            )
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise RequestError(
                f"sampling_params: one SamplingParams, or a list of {n} (one per prompt); got "
                f"{len(params)} items of types {sorted({type(p).__name__ for p in params})}"
            )
        return params

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of ``{"role", "content"}`` messages) or to each
        of several (a list of such lists: vLLM's ``messages``), through the model's chat
        template; outputs in order. As vLLM's: a conversation ends with the assistant's
        header (``add_generation_prompt``), or its last message is left open for the model
        to go on with (``continue_final_message``, with add_generation_prompt False: an
        assistant prefill such as "Sure, the JSON: {"); ``chat_template_kwargs`` sets more
        of the template's variables (Qwen3's ``{"enable_thinking": False}``)."""
        conversations = self._as_list(messages, "messages")
        for i, c in enumerate(conversations):
            if not (isinstance(c, list) and c and all(isinstance(m, dict) for m in c)):
                raise RequestError(
                    f"messages[{i}]: a conversation must be a non-empty list of {{role, content}} messages"
                )
        chat = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
        }
        return self._generate(conversations, sampling_params, use_tqdm, "messages", chat)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one completion as tokens are generated."""
        encoded = [self.encode(prompt)]
        params = self._params_per_prompt(sampling_params, 1)[0]
        if params.n != 1:
            raise RequestError(f"sampling_params.n = {params.n}: stream gives one completion; use generate for n > 1")
        if self.engine.handoff is not None:
            yield from (delta.text for _, delta in self._served(encoded, params) if delta.text)
            return
        with self.engine.owned_by_current_thread("an offline LLM.stream call"):
            request = self.engine.add_request(encoded[0], params)
            sent = 0
            for _ in self._steps([request]):
                if len(request.output_chunks) > sent:
                    yield "".join(request.output_chunks[sent:])
                    sent = len(request.output_chunks)

    def pin(self, prompt: Prompt, ttl_s: float = 60.0) -> PinnedPrefix:
        """Computes ``prompt`` (what of it is not cached) as a prefill-only request and pins
        it in the prefix cache: no request's memory pressure evicts it until ``unpin`` or
        until ``ttl_s`` seconds have passed (so a crashed caller cannot pin memory forever).

        Raises:
            RequestError: ``ttl_s`` out of range, no prefix cache, or the pin would take more
                than half the KV pool (with the other leases).
        """
        ids = self.encode(prompt)
        params = SamplingParams(max_tokens=0)
        if self.engine.handoff is not None:
            request = next(sub.request for sub, delta in self._served([ids], params, ttl_s) if delta.finish_reason)
        else:
            with self.engine.owned_by_current_thread("an offline LLM.pin call"):
                request = self.engine.add_request(ids, params, pin_s=ttl_s)
                for _ in self._steps([request]):
                    pass
        if request.lease_id is None:
            raise RequestError(f"pin: {request.pin_refused or 'the request ended before its prompt was computed'}")
        return PinnedPrefix(request.lease_id, request.num_prompt_tokens, request.num_cached_tokens)

    def unpin(self, lease: PinnedPrefix | str) -> bool:
        """Ends a pin now; False if it had ended or expired already."""
        lease_id = lease.lease_id if isinstance(lease, PinnedPrefix) else lease
        if not isinstance(lease_id, str):
            raise RequestError(
                f"unpin: a PinnedPrefix (what pin returned) or its lease_id; got a {type(lease).__name__}"
            )
        if self.engine.handoff is not None:
            return bool(self.engine.handoff.call(lambda engine: engine.unpin(lease_id)))
        with self.engine.owned_by_current_thread("an offline LLM.unpin call"):
            return self.engine.unpin(lease_id)

    def _steps(self, requests: list[Request]) -> Iterator[None]:
        """Steps the engine (this thread owns it) until ``requests`` finish, yielding after
        each step. Then, or when the caller stops early or a step fails, aborts what is
        unfinished (freeing its pages) and, if a failed step took the donated KV cache,
        makes a fresh one for the next call."""
        try:
            done = 0  # requests[:done] have finished: each is looked at until it has, not every step
            while True:
                while done < len(requests) and requests[done].status.is_finished:
                    done += 1
                if done == len(requests):
                    break
                self.engine.step()
                yield
        finally:
            for r in requests:
                self.engine.abort(r.request_id)
            if self.engine.runner.kv_cache_lost and not self.engine.has_unfinished():
                self.engine.recover()

    def _served(
        self, encoded: list[list[int]], params: SamplingParams | list[SamplingParams], pin_s: float | None = None
    ) -> Iterator[tuple[Any, Any]]:
        """Submits every prompt to the serving engine thread at once; yields (submission,
        delta) of each in turn, in prompt order. What is unfinished when the caller stops
        (or a delta reports a failed step) is aborted."""
        handoff = self.engine.handoff
        ids = [f"offline-{uuid.uuid4().hex}" for _ in encoded]
        per_prompt = params if isinstance(params, list) else [params] * len(encoded)
        subs = [
            handoff.submit_threadsafe(i, p, sp, enforce_limit=False, pin_s=pin_s)
            for i, p, sp in zip(ids, encoded, per_prompt, strict=True)
        ]
        done = 0
        try:
            for sub in subs:
                while True:
                    delta = sub.deltas.get()
                    if delta.error is not None:
                        raise EngineError(delta.error)
                    yield sub, delta
                    if delta.finish_reason is not None:
                        break
                done += 1
        finally:
            for request_id in ids[done:]:  # an abort queued behind its add finds the request
                handoff.abort(request_id)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a Hugging Face tokenizer; vLLM's method)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix that no running request holds and no ``pin`` keeps
        (vLLM's method: a benchmark's next run then starts cold). True, as vLLM's."""

        def reset(engine) -> bool:
            engine.scheduler.kv.drop_unpinned_prefixes()
            return True

        if self.engine.handoff is not None:
            return self.engine.handoff.call(reset)
        with self.engine.owned_by_current_thread("an offline LLM.reset_prefix_cache call"):
            return reset(self.engine)

    def stats(self) -> dict[str, int]:
        """Counters: steps, prefill_tokens_computed, decode_tokens, num_preemptions, num_compiles, kv_pages_*.
        On a served LLM they are read on the engine thread, between steps (never half of one)."""
        handoff = self.engine.handoff
        if handoff is not None:
            try:
                return handoff.call(lambda engine: engine.stats())
            except EngineStoppedError:  # it stopped since: the engine is idle, read it here
                pass
        return self.engine.stats()

    @property
    def platform(self) -> str:
        return jax.default_backend()
