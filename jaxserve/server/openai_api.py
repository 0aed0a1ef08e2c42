"""The OpenAI-compatible HTTP API, served beside gRPC over the same engine thread.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``POST /detokenize``. Requests are pydantic models
that ignore unknown fields, as OpenAI's API does; a bad value is a 400 with OpenAI's error
body naming the field (``param``). A full queue is 429, a server still warming up or
draining is 503. Streams are server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``; a client that goes away (stream or not) aborts its requests at the next
step boundary, which frees their pages, as a gRPC cancel does.

Validation and tokenizing run on a worker thread (as for gRPC); submission and the deltas
go through ``submit.py``, the code the gRPC servicer uses too, so both transports give
the same tokens for the same request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import re
import time
import types
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Union, get_args, get_origin

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxserve.assembly import EngineHandle
from jaxserve.engine.async_engine import Delta, EngineStoppedError, EngineThread, QueueFullError, RequestIdInUseError
from jaxserve.errors import RequestError, check_token_ids
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.auth import TokenAuth
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import Metrics
from jaxserve.server.submit import merged, sample_ids, submit_all
from jaxserve.server.validation import CHAT_ROLES, checked_params

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_ERROR_CHARS = 1000


class APIError(Exception):
    """An answer other than 200: status, OpenAI error type, message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error"}.get(
            status, "server_error"
        )

    def response(self) -> JSONResponse:
        message = self.message
        if len(message) > MAX_ERROR_CHARS:
            message = f"{message[:MAX_ERROR_CHARS]}... (cut at {MAX_ERROR_CHARS} characters)"
        body = {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _bad_request(e: RequestError, renames: dict[str, str] | None = None) -> APIError:
    """A RequestError as a 400 naming its field: "sampling_params.top_p = 1.5: ..." is
    the request's ``top_p``."""
    message = str(e).replace("sampling_params.", "")
    for ours, theirs in (renames or {}).items():
        message = re.sub(rf"^{ours}\b", theirs, message)
    m = re.match(r"[A-Za-z_][\w.]*(\[\d+\])?[\w.]*", message)
    return APIError(400, message, param=m.group(0) if m else None)


# --- request bodies (unknown fields are ignored, as OpenAI's API does) ---------------

# A union member's tag in a pydantic error's path: "prompt.list[int].0" (prompt as token ids).
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")


def _union_field(loc) -> tuple[tuple[str, ...], str | None]:
    """(the path before the first union member's tag, the tag) of an error's ``loc``."""
    path = [str(x) for x in loc if x != "body"]
    at = next((i for i, x in enumerate(path) if _UNION_MEMBER.match(x)), len(path))
    return tuple(path[:at]), path[at] if at < len(path) else None


class _Body(BaseModel):
    # Strict types, as OpenAI's own API: pydantic's lax mode took true as token id 1,
    # "5" as 5 and max_tokens = true as 1. An int is still a number.
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API takes null for every optional field as its default (clients send
        "n": null, "stream": null, "logprobs": null); a field that cannot be None then
        takes its default. A required field's null stays an error."""
        if isinstance(data, dict):
            defaulted = _not_nullable_with_default(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


@functools.cache
def _not_nullable_with_default(model: type[BaseModel]) -> frozenset[str]:
    def nullable(annotation) -> bool:
        return annotation is Any or (
            get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)
        )

    fields = model.model_fields.items()
    return frozenset(name for name, f in fields if not f.is_required() and not nullable(f.annotation))


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    type: str = "text"
    json_schema: Any = None  # {"name": ..., "schema": {...}, "strict": ...}


class _Sampling(_Body):
    """The fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output by vLLM's names (OpenAI's is response_format).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    prompt_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM's: the assistant's header after the last message
    continue_final_message: bool = False  # vLLM's: the last message left open (an assistant prefill)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# --- the API -------------------------------------------------------------------------


class OpenAIServer:
    """The HTTP front end: builds the FastAPI app over an engine thread that the gRPC
    server shares. ``state()`` says "warming_up", "serving" or "draining"."""

    def __init__(
        self,
        handle: EngineHandle,
        engine_thread: EngineThread,
        model_name: str,
        cfg: ServerConfig,
        state: Callable[[], str],
        auth: TokenAuth | None = None,
        metrics: Metrics | None = None,
    ):
        self.handle = handle
        self.engine = engine_thread
        self.model_name = model_name
        self.limits = cfg
        self.state = state
        self.auth = auth
        self.metrics = metrics
        self._ids = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-http-validate")
        self.app = self._build()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers ----------------------------------------------------------------------

    def _refused(self, reason: str, error: APIError) -> APIError:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()
        return error

    def _client(self, request: Request) -> str:
        """Who is calling: the bearer token's identity, else the peer's address, in the
        gRPC servicer's form (so per-client limits count both transports alike)."""
        if self.auth is not None:
            identity = self.auth.identity(request.headers.items())
            if identity is None:
                raise APIError(
                    401, "a valid API key is required (Authorization: Bearer <token>)", code="invalid_api_key"
                )
            return f"id:{identity}"
        host = request.client.host if request.client else "unknown"
        return f"ipv6:[{host}]" if ":" in host else f"ipv4:{host}"

    def _check_ready(self) -> None:
        state = self.state()
        if state != "serving":
            message = "the server is warming up" if state == "warming_up" else "the server is shutting down"
            raise self._refused("shutting_down" if state == "draining" else "warming_up", APIError(503, message))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model = {model!r}: this server serves {self.model_name!r}", param="model")

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per server, as long-lived as it
    def _token_bytes(self, token_id: int) -> list[int]:
        return list(self.handle.token_bytes(token_id))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - as _token_bytes
    def _token_text(self, token_id: int) -> str:
        # From the token's own bytes, not the tokenizer's decode of it alone: a SentencePiece
        # tokenizer's (Llama 2, Mistral) drops a lone token's leading space ("▁Paris" ->
        # "Paris"), and then the tokens no longer add up to the text.
        return bytes(self._token_bytes(token_id)).decode("utf-8", errors="replace")

    def _ready_token_texts(self, kwargs: dict) -> None:
        """With logprobs asked for: the tokenizer's byte view built now, on the worker pool
        (~0.3 s once), not on the event loop when the first token's text is wanted."""
        if kwargs.get("logprobs") is not None or kwargs.get("prompt_logprobs") is not None:
            self.handle.token_bytes(0)

    def _encode(self, prompt, field: str, **chat) -> list[int]:
        """Token ids of a text, id list or chat (``chat``: how it ends, ``EngineHandle.encode``),
        within the server's prompt limits."""
        limits = self.limits
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{field}: the prompt is empty", param=field)
            if len(prompt) > limits.max_prompt_chars:
                raise APIError(
                    400,
                    f"{field}: {len(prompt)} characters; at most {limits.max_prompt_chars} (server.max_prompt_chars)",
                    param=field,
                )
        elif not prompt:
            raise APIError(400, f"{field}: the prompt is empty", param=field)
        try:
            ids = self.handle.encode(prompt, field, **chat)
        except jinja2.TemplateError as e:
            raise APIError(
                400, f"{field}: the model's chat template refuses them: {str(e)[:300]}", param=field
            ) from None
        except RequestError as e:
            raise _bad_request(e) from None
        if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
            raise APIError(
                400,
                f"{field}: {len(ids)} tokens; this server allows at most {limits.max_prompt_tokens} "
                f"(server.max_prompt_tokens)",
                param=field,
            )
        return ids

    def _messages(self, messages: list[ChatMessage]) -> list[dict]:
        out, total = [], 0
        for i, m in enumerate(messages):
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
            if role not in CHAT_ROLES:
                shown = m.role if len(m.role) <= 40 else f"{m.role[:40]}..."
                raise APIError(
                    400,
                    f"messages[{i}].role = {shown!r}: must be one of {', '.join(CHAT_ROLES)}, developer",
                    param=f"messages[{i}].role",
                )
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise APIError(
                            400,
                            f"messages[{i}].content[{j}].type = {part.type!r}: only text parts are served",
                            param=f"messages[{i}].content[{j}].type",
                        )
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            total += len(content)
            if total > self.limits.max_prompt_chars:
                raise APIError(
                    400,
                    f"messages: over {self.limits.max_prompt_chars} characters in all (server.max_prompt_chars)",
                    param="messages",
                )
            out.append({"role": role, "content": content})
        return out

    @staticmethod
    def _structured(body: _Sampling) -> tuple[str, dict]:
        """(the request's field, SamplingParams keyword) of its structured-output constraint:
        OpenAI's response_format, or vLLM's guided_* / structured_outputs."""
        found = []
        rf = body.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif rf.type == "json_schema":
                spec = rf.json_schema
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                    raise APIError(
                        400,
                        "response_format.json_schema.schema: a JSON schema (an object) is required",
                        param="response_format.json_schema.schema",
                    )
                found.append(("response_format", {"json_schema": json.dumps(spec["schema"])}))
            else:
                raise APIError(
                    400,
                    f"response_format.type = {rf.type!r}: must be one of text, json_object, json_schema",
                    param="response_format.type",
                )
        so = body.structured_outputs if isinstance(body.structured_outputs, dict) else {}
        if body.structured_outputs is not None and not isinstance(body.structured_outputs, dict):
            raise APIError(400, "structured_outputs: must be an object", param="structured_outputs")
        for field, value, key in (
            ("guided_json", body.guided_json, "json_schema"),
            ("guided_regex", body.guided_regex, "regex"),
            ("guided_choice", body.guided_choice, "choice"),
            ("guided_grammar", body.guided_grammar, "grammar"),
            ("structured_outputs.json", so.get("json"), "json_schema"),
            ("structured_outputs.regex", so.get("regex"), "regex"),
            ("structured_outputs.choice", so.get("choice"), "choice"),
            ("structured_outputs.grammar", so.get("grammar"), "grammar"),
        ):
            if value is None:
                continue
            if key == "json_schema" and not isinstance(value, str):
                value = json.dumps(value)
            elif key == "choice":
                if not isinstance(value, list) or not value:
                    raise APIError(400, f"{field}: must be a non-empty list of strings", param=field)
                value = tuple(value)
            found.append((field, {key: value}))
        if len(found) > 1:
            raise APIError(
                400,
                f"{found[1][0]}: only one structured-output constraint, {found[0][0]} is set too",
                param=found[1][0],
            )
        return found[0] if found else ("", {})

    def _sampling_kwargs(self, body: _Sampling) -> dict:
        """SamplingParams keyword arguments of the shared fields; refuses by name what is
        not served."""
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of = {body.best_of}: only best_of == n is served", param="best_of")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only with stream = true", param="stream_options")
        if body.prompt_logprobs is not None and body.stream:  # as vLLM: they come with the whole response
            raise APIError(400, "prompt_logprobs: not available with stream = true", param="prompt_logprobs")
        kwargs: dict[str, Any] = dict(
            n=body.n,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "min_p"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
        if body.repetition_penalty is not None:
            kwargs["repetition_penalty"] = body.repetition_penalty
        if body.top_k is not None:
            kwargs["top_k"] = 0 if body.top_k == -1 else body.top_k  # vLLM's -1: no top-k
        if body.stop is not None:
            kwargs["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        if body.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(body.stop_token_ids)
        if body.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = body.prompt_logprobs
        if body.logit_bias:
            try:  # OpenAI's keys are token ids as strings
                kwargs["logit_bias"] = tuple((int(k), v) for k, v in body.logit_bias.items())
            except ValueError:
                raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
        field, constraint = self._structured(body)
        kwargs.update(constraint)
        # Errors about the constraint name the field the client used.
        renames = {f"{key}": field for key in constraint if field != key}
        return kwargs, renames

    def _params(self, kwargs: dict, prompt_len: int, default_max_tokens: int, renames=None) -> SamplingParams:
        """Within the server's limits, its constraint (if any) compiled: on the worker."""
        try:
            params = checked_params(
                kwargs, prompt_len, self.handle.max_model_len, self.limits.max_tokens_limit, default_max_tokens
            )
            self.handle.engine.check_params(params)
            return params
        except RequestError as e:
            raise _bad_request(e, renames) from None

    # -- preparing (on a worker thread) -------------------------------------------------

    def _prepare_completion(self, body: CompletionRequest) -> list[tuple[list[int], SamplingParams, str]]:
        """(prompt ids, params, echoed text) per prompt."""
        if body.suffix:
            raise APIError(400, "suffix: not supported by this server", param="suffix")
        if body.echo and body.logprobs is not None and body.stream:
            raise APIError(
                400,
                "echo: with logprobs, not available with stream = true (the prompt's logprobs come with the "
                "whole response)",
                param="echo",
            )
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt: at least one prompt is required", param="prompt")
        kwargs, renames = self._sampling_kwargs(body)
        if body.logprobs is not None:
            kwargs["logprobs"] = body.logprobs
            if body.echo:  # as vLLM: the echoed prompt's tokens get logprobs too (eval harnesses' loglikelihood)
                kwargs.setdefault("prompt_logprobs", body.logprobs)
        self._ready_token_texts(kwargs)
        if body.max_tokens is not None:
            kwargs["max_tokens"] = body.max_tokens
        out = []
        for i, p in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = self._encode(p, field)
            echo = (p if isinstance(p, str) else self.handle.tokenizer.decode(ids)) if body.echo else ""
            out.append((ids, self._params(kwargs, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, renames), echo))
        return out

    def _chat_ids(self, body: ChatRequest | TokenizeRequest) -> list[int]:
        """A chat's token ids as vLLM renders it: the assistant's header after the last
        message (add_generation_prompt, the default); nothing after it, the turn closed
        (add_generation_prompt = false); or the last message left open for the model to go
        on with (continue_final_message: an assistant prefill, "Sure, here is the JSON: {")."""
        messages = self._messages(body.messages)
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message = true: only with add_generation_prompt = false (the last message is "
                "continued, not answered)",
                param="continue_final_message",
            )
        return self._encode(
            messages,
            "messages",
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )

    def _prepare_chat(self, body: ChatRequest) -> tuple[list[int], SamplingParams]:
        if body.tools:
            raise APIError(400, "tools: tool calling is not supported by this server", param="tools")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: only with logprobs = true", param="top_logprobs")
        ids = self._chat_ids(body)
        kwargs, renames = self._sampling_kwargs(body)
        if body.logprobs:
            kwargs["logprobs"] = body.top_logprobs or 0
            if body.top_logprobs is not None:
                renames["logprobs"] = "top_logprobs"
        self._ready_token_texts(kwargs)
        if body.max_completion_tokens is not None:
            kwargs["max_tokens"] = body.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        elif body.max_tokens is not None:
            kwargs["max_tokens"] = body.max_tokens
        return ids, self._params(kwargs, len(ids), 1024, renames)

    async def _prepared(self, fn, body):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, body)

    # -- submitting and collecting ----------------------------------------------------

    def _submit(self, request_id: str, prompts: list[tuple[list[int], SamplingParams]], client: str):
        """Submits every sample of every prompt; returns (engine ids, queues). Choice
        index = prompt index * n + sample index."""
        jobs = []
        for p, (ids, params) in enumerate(prompts):
            base = request_id if len(prompts) == 1 else f"{request_id}-{p}"
            for engine_id, sample in zip(sample_ids(base, params.n), params.samples(), strict=True):
                jobs.append((engine_id, ids, sample))
        try:
            return [j[0] for j in jobs], submit_all(self.engine, jobs, client)
        except RequestError as e:
            raise self._refused("invalid_argument", _bad_request(e)) from None
        except QueueFullError as e:
            raise self._refused(
                e.reason, APIError(429, str(e), type_="rate_limit_error", code="rate_limit_exceeded")
            ) from None
        except EngineStoppedError as e:
            raise self._refused("shutting_down", APIError(503, str(e))) from None
        except RequestIdInUseError as e:
            raise self._refused("request_id_in_use", APIError(409, str(e))) from None

    async def _deltas(self, engine_ids: list[str], queues) -> AsyncIterator[tuple[int, Delta]]:
        try:
            async for i, delta in merged(queues):
                if delta.error is not None:
                    raise APIError(500, delta.error)
                yield i, delta
        finally:  # the client went away, or an error: free the engine's pages
            for engine_id in engine_ids:
                self.engine.abort(engine_id)

    @staticmethod
    async def _until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _unless_disconnected(self, request: Request, work):
        """Runs ``work`` (a coroutine); a client that disconnects first cancels it (which
        aborts its requests)."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._until_disconnected(request))
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled():
            return Response(status_code=499)  # nobody is listening
        return task.result()

    @staticmethod
    def _usage(finals: dict[int, Delta], n: int) -> dict:
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

    def _stop_reason(self, reason: int | str | None, params: SamplingParams) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop token id that ended the output, None
        for the tokenizer's end-of-sequence token (the engine's own reason names it too)."""
        if not params.ignore_eos and reason == self.handle.tokenizer.eos_token_id:
            return None
        return reason

    def _completion_logprobs(self, ids: list[int], lps: list[float], tops, offset: int) -> dict:
        tokens = [self._token_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [None if top is None else {self._token_text(t): lp for t, lp in top} for top in tops],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, ids: list[int], lps: list[float], tops) -> dict:
        def entry(t, lp):
            text = self._token_text(t)
            # The token's own bytes, as OpenAI's: a piece of a character shows as U+FFFD in
            # `token` (as vLLM's), and the pieces' bytes joined give the character.
            return {"token": text, "logprob": lp, "bytes": self._token_bytes(t)}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                for t, lp, top in zip(ids, lps, tops, strict=True)
            ]
        }

    def _prompt_logprobs(self, ids: list[int], delta: Delta) -> list | None:
        """vLLM's shape: None for the first token, then {token id: {logprob, decoded_token}}."""
        if delta.prompt_logprobs is None:
            return None
        out = []
        for t, lp, top in zip(ids, delta.prompt_logprobs, delta.prompt_top_logprobs, strict=True):
            if lp is None:
                out.append(None)
                continue
            entries = {t: lp, **{a: b for a, b in top or ()}}
            out.append({str(a): {"logprob": b, "decoded_token": self._token_text(a)} for a, b in entries.items()})
        return out

    # -- endpoints --------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        client = self._client(request)  # unauthenticated callers learn nothing else
        self._check_ready()
        self._check_model(body.model)
        prepared = await self._prepared(self._prepare_completion, body)
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        n = prepared[0][1].n
        engine_ids, queues = self._submit(request_id, [(ids, params) for ids, params, _ in prepared], client)
        created = int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        with_logprobs = body.logprobs is not None
        deltas = self._deltas(engine_ids, queues)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            async def events():
                finals: dict[int, Delta] = {}
                offsets = [len(prepared[i // n][2]) for i in range(len(engine_ids))]
                echoed = set()
                async for i, d in deltas:
                    text = d.text
                    if i not in echoed and prepared[i // n][2]:
                        text = prepared[i // n][2] + text
                    echoed.add(i)
                    choice = {
                        "index": i,
                        "text": text,
                        "logprobs": self._completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, offsets[i])
                        if with_logprobs
                        else None,
                        "finish_reason": d.finish_reason,
                    }
                    offsets[i] += len(d.text)
                    if d.finish_reason is not None:
                        finals[i] = d
                        choice["stop_reason"] = self._stop_reason(d.stop_reason, prepared[i // n][1])
                    if text or d.token_ids or d.finish_reason is not None:
                        yield _event({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
                if include_usage:
                    yield _event({**head, "choices": [], "usage": self._usage(finals, n)})

            return StreamingResponse(_sse(events()), media_type="text/event-stream")

        async def collect():
            gathered = await _gather(deltas, len(engine_ids))
            choices = []
            for i, c in enumerate(gathered):
                echo = prepared[i // n][2]
                choice = {"index": i, "text": echo + c.text, "logprobs": None, "finish_reason": c.final.finish_reason}
                if with_logprobs and body.echo:  # the prompt's tokens first; the very first has no logprob
                    scored = gathered[i - i % n].final  # the prompt's first sample computed it
                    tops = [None if t is None else list(t)[: body.logprobs] for t in scored.prompt_top_logprobs]
                    choice["logprobs"] = self._completion_logprobs(
                        [*prepared[i // n][0], *c.token_ids],
                        [*scored.prompt_logprobs, *c.logprobs],
                        [*tops, *c.top_logprobs],
                        0,
                    )
                elif with_logprobs:
                    choice["logprobs"] = self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, len(echo))
                choice["stop_reason"] = self._stop_reason(c.final.stop_reason, prepared[i // n][1])
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(prepared[i // n][0], c.final)
                choices.append(choice)
            return {**head, "choices": choices, "usage": self._usage({i: c.final for i, c in enumerate(gathered)}, n)}

        return await self._unless_disconnected(request, collect())

    async def chat(self, body: ChatRequest, request: Request):
        client = self._client(request)  # unauthenticated callers learn nothing else
        self._check_ready()
        self._check_model(body.model)
        ids, params = await self._prepared(self._prepare_chat, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        n = params.n
        engine_ids, queues = self._submit(request_id, [(ids, params)], client)
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": self.model_name}
        deltas = self._deltas(engine_ids, queues)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            chunk_head = {**head, "object": "chat.completion.chunk"}
            usage_null = {"usage": None} if include_usage else {}

            async def events():
                for i in range(n):  # each choice opens with its role, as OpenAI's do
                    choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield _event({**chunk_head, "choices": [{**choice, "finish_reason": None}], **usage_null})
                finals: dict[int, Delta] = {}
                async for i, d in deltas:
                    if not (d.text or d.token_ids or d.finish_reason is not None):
                        continue
                    choice = {
                        "index": i,
                        "delta": {"content": d.text} if d.text else {},
                        "logprobs": self._chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)
                        if body.logprobs
                        else None,
                        "finish_reason": d.finish_reason,
                    }
                    if d.finish_reason is not None:
                        finals[i] = d
                        choice["stop_reason"] = self._stop_reason(d.stop_reason, params)
                    yield _event({**chunk_head, "choices": [choice], **usage_null})
                if include_usage:
                    yield _event({**chunk_head, "choices": [], "usage": self._usage(finals, n)})

            return StreamingResponse(_sse(events()), media_type="text/event-stream")

        async def collect():
            gathered = await _gather(deltas, n)
            choices = []
            for i, c in enumerate(gathered):
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.final.finish_reason,
                    "stop_reason": self._stop_reason(c.final.stop_reason, params),
                }
                if body.logprobs:
                    choice["logprobs"] = self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                choices.append(choice)
            reply = {**head, "choices": choices, "usage": self._usage({i: c.final for i, c in enumerate(gathered)}, n)}
            if body.prompt_logprobs is not None:  # vLLM's place: the response's, one prompt for every choice
                reply["prompt_logprobs"] = self._prompt_logprobs(ids, gathered[0].final)
            return reply

        return await self._unless_disconnected(request, collect())

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "jaxserve",
                    "max_model_len": self.handle.max_model_len,
                }
            ],
        }

    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        self._client(request)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt, messages: give exactly one", param="prompt")

        def run():
            if body.messages is not None:
                return self._chat_ids(body)
            if not body.add_special_tokens:
                return self._encode(self.handle.tokenizer.encode(body.prompt, add_special_tokens=False), "prompt")
            return self._encode(body.prompt, "prompt")

        ids = await self._prepared(lambda _: run(), None)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.handle.max_model_len}

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        self._client(request)
        self._check_model(body.model)
        try:
            check_token_ids(body.tokens, self.handle.model_config.vocab_size, "tokens")
        except RequestError as e:
            raise _bad_request(e) from None
        return {"prompt": self.handle.tokenizer.decode(body.tokens)}

    def tokenizer_info(self, request: Request) -> dict:
        """vLLM's ``/tokenizer_info`` (opt-in there): the special tokens and the chat template,
        what eval harnesses (lm-eval's remote tokenizer) need to tokenize as the server does."""
        self._client(request)
        tok = self.handle.tokenizer
        info = {name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        info.update(
            tokenizer_class=type(tok).__name__,
            model_max_length=self.handle.max_model_len,
            chat_template=getattr(tok, "chat_template", None),
        )
        return info

    def _build(self) -> FastAPI:
        app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request, e: APIError):
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def invalid(request, e: RequestValidationError):
            errors = e.errors()
            first = errors[0] if errors else {}
            field, member = _union_field(first.get("loc", ()))
            # Our own errors' style: messages[0].content, not messages.0.content.
            param = "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in field).lstrip(".") or None
            if first.get("type") == "json_invalid":
                message, param = "the body is not valid JSON", None
            elif member is not None:  # a union (prompt: str | list[int] | ...) none of whose members took it
                # A member of our own request types reads as what the client sends: an object
                # (content: "list[object]", not pydantic's "list[ContentPart]").
                members = dict.fromkeys(
                    re.sub(r"\b[A-Z]\w*", "object", m)
                    for f, m in (_union_field(err["loc"]) for err in errors)
                    if f == field
                )
                message = f"{param}: must be one of {', '.join(members)}"
            else:
                message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
            return self._refused("invalid_argument", APIError(400, message, param=param)).response()

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.state() == "serving" else 503)

        @app.get("/v1/models")
        async def models(request: Request):
            self._client(request)
            return self.models()

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/tokenizer_info")(self.tokenizer_info)
        return app


@dataclasses.dataclass
class _Gathered:
    """One choice's deltas, joined."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    final: Delta | None = None


async def _gather(deltas: AsyncIterator[tuple[int, Delta]], n: int) -> list[_Gathered]:
    """Every delta of ``n`` choices, joined per choice (a non-streaming answer)."""
    out = [_Gathered() for _ in range(n)]
    async for i, d in deltas:
        c = out[i]
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        c.top_logprobs += d.top_logprobs
        if d.finish_reason is not None:
            c.final = d
    return out


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then ``[DONE]``; an engine error mid-stream ends it with an error event
    (the status line has gone out already)."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield _event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
    yield "data: [DONE]\n\n"
