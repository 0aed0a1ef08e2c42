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
the same tokens for the same request. Beside this module: ``openai_protocol.py`` (the
request bodies and the error), ``openai_prepare.py`` (a body as prompt ids and
SamplingParams) and ``openai_reply.py`` (deltas as OpenAI's answer pieces).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.assembly import EngineHandle
from jaxserve.engine.async_engine import Delta, EngineStoppedError, EngineThread, QueueFullError, RequestIdInUseError
from jaxserve.errors import RequestError, check_token_ids
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.auth import TokenAuth
from jaxserve.server.body_limit import BodyLimit
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import Metrics
from jaxserve.server.openai_prepare import RequestPreparer
from jaxserve.server.openai_protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    StreamOptions,
    TokenizeRequest,
    bad_request,
    validation_error,
)
from jaxserve.server.openai_reply import ReplyFormatter, event, gather, running_usage, sse, usage
from jaxserve.server.openai_responses import ResponseBuilder
from jaxserve.server.submit import merged, sample_ids, submit_all


def _stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """A stream's usage: (a usage field in every chunk and the counts in a last one, the
    counts so far in every chunk). The second is vLLM's ``continuous_usage_stats``, which
    takes effect with ``include_usage`` only, as there."""
    include = options is not None and options.include_usage
    return include, include and options.continuous_usage_stats


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
        self.state = state
        self.auth = auth
        self.metrics = metrics
        self.prepare = RequestPreparer(handle, cfg)
        self.reply = ReplyFormatter(handle)
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-http-validate")
        self.app = self._build(cfg.max_request_bytes)

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

    async def _prepared(self, fn, body):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, body)

    async def _accepted(self, request: Request, model: type[BaseModel]) -> tuple[str, Any]:
        """(the caller, the body as ``model``) of a generating request: the caller known
        first (an unauthenticated one learns nothing else), then the server ready, the body
        parsed and its model this server's."""
        client = self._client(request)
        self._check_ready()
        body = await self._body(request, model)
        self._check_model(body.model)
        return client, body

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        """The request's body as ``model``, parsed and checked on the worker pool after the
        caller is known (an unknown caller's body is never parsed). A 15 MB body of token
        ids held a running stream's next token 2.45 s on the event loop (a tiny model's
        server; SmolLM2's 4.5 s); here, with the prompt's union checked member-first
        (``CompletionRequest``), 0.21 s (SmolLM2's 0.6-0.9 s, its engine thread sharing the
        GIL): the JSON parse itself holds the GIL. A bad body is one 400 naming the field."""
        raw = await request.body()
        try:
            return await self._prepared(model.model_validate_json, raw)
        except ValidationError as e:
            raise self._refused("invalid_argument", validation_error(e.errors())) from None

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
            raise self._refused("invalid_argument", bad_request(e)) from None
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
        if not task.done():
            # Cancelled, it is done only once it has run its cleanup (its requests' aborts):
            # its result read before that was an InvalidStateError, a traceback per
            # disconnected client.
            await asyncio.wait((task,))
        if task.cancelled():
            return Response(status_code=499)  # nobody is listening
        return task.result()

    # -- endpoints --------------------------------------------------------------------

    async def completions(self, request: Request):
        client, body = await self._accepted(request, CompletionRequest)
        prepared = await self._prepared(self.prepare.completion, body)
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        n = prepared[0][1].n
        engine_ids, queues = self._submit(request_id, [(ids, params) for ids, params, _ in prepared], client)
        created = int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        with_logprobs = body.logprobs is not None
        deltas = self._deltas(engine_ids, queues)
        if body.stream:
            include_usage, continuous = _stream_usage(body.stream_options)

            async def events():
                finals: dict[int, Delta] = {}
                offsets = [len(prepared[i // n][2]) for i in range(len(engine_ids))]
                generated = [0] * len(engine_ids)  # each choice's tokens so far
                echoed = set()
                async for i, d in deltas:
                    generated[i] += len(d.token_ids)
                    text, first = d.text, i not in echoed  # the choice's first chunk sent (echo, ids)
                    if first and prepared[i // n][2]:
                        text = prepared[i // n][2] + text
                    choice = {
                        "index": i,
                        "text": text,
                        "logprobs": self.reply.completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, offsets[i])
                        if with_logprobs
                        else None,
                        "finish_reason": d.finish_reason,
                    }
                    if body.return_token_ids:  # as vLLM: the prompt's with each choice's first chunk
                        choice["token_ids"] = d.token_ids
                        if first:
                            choice["prompt_token_ids"] = prepared[i // n][0]
                    offsets[i] += len(d.text)
                    if d.finish_reason is not None:
                        finals[i] = d
                        choice["stop_reason"] = self.reply.stop_reason(d.stop_reason, prepared[i // n][1])
                    if text or d.token_ids or d.finish_reason is not None:
                        echoed.add(i)
                        chunk_usage = running_usage(len(prepared[i // n][0]), generated[i]) if continuous else None
                        yield event({**head, "choices": [choice], **({"usage": chunk_usage} if include_usage else {})})
                if include_usage:
                    yield event({**head, "choices": [], "usage": usage(finals, n)})

            return StreamingResponse(sse(events()), media_type="text/event-stream")

        async def collect():
            gathered = await gather(deltas, len(engine_ids))
            choices = []
            for i, c in enumerate(gathered):
                echo = prepared[i // n][2]
                choice = {"index": i, "text": echo + c.text, "logprobs": None, "finish_reason": c.final.finish_reason}
                if with_logprobs and body.echo:  # the prompt's tokens first; the very first has no logprob
                    scored = gathered[i - i % n].final  # the prompt's first sample computed it
                    tops = [None if t is None else list(t)[: body.logprobs] for t in scored.prompt_top_logprobs]
                    choice["logprobs"] = self.reply.completion_logprobs(
                        [*prepared[i // n][0], *c.token_ids],
                        [*scored.prompt_logprobs, *c.logprobs],
                        [*tops, *c.top_logprobs],
                        0,
                    )
                elif with_logprobs:
                    choice["logprobs"] = self.reply.completion_logprobs(
                        c.token_ids, c.logprobs, c.top_logprobs, len(echo)
                    )
                choice["stop_reason"] = self.reply.stop_reason(c.final.stop_reason, prepared[i // n][1])
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.reply.prompt_logprobs(prepared[i // n][0], c.final)
                if body.return_token_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = prepared[i // n][0], c.token_ids
                choices.append(choice)
            return {**head, "choices": choices, "usage": usage({i: c.final for i, c in enumerate(gathered)}, n)}

        return await self._unless_disconnected(request, collect())

    async def chat(self, request: Request):
        client, body = await self._accepted(request, ChatRequest)
        ids, params = await self._prepared(self.prepare.chat, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        n = params.n
        engine_ids, queues = self._submit(request_id, [(ids, params)], client)
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": self.model_name}
        deltas = self._deltas(engine_ids, queues)
        if body.stream:
            include_usage, continuous = _stream_usage(body.stream_options)
            chunk_head = {**head, "object": "chat.completion.chunk"}
            generated = [0] * n  # each choice's tokens so far

            def chunk_usage(i: int) -> dict:
                if not include_usage:
                    return {}
                return {"usage": running_usage(len(ids), generated[i]) if continuous else None}

            async def events():
                for i in range(n):  # each choice opens with its role, as OpenAI's do
                    choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    # vLLM's return_token_ids: the prompt's ids with the first chunk
                    ids_first = {"prompt_token_ids": ids} if body.return_token_ids and i == 0 else {}
                    yield event(
                        {**chunk_head, "choices": [{**choice, "finish_reason": None}], **chunk_usage(i), **ids_first}
                    )
                finals: dict[int, Delta] = {}
                async for i, d in deltas:
                    if not (d.text or d.token_ids or d.finish_reason is not None):
                        continue
                    generated[i] += len(d.token_ids)
                    choice = {
                        "index": i,
                        "delta": {"content": d.text} if d.text else {},
                        "logprobs": self.reply.chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)
                        if body.logprobs
                        else None,
                        "finish_reason": d.finish_reason,
                    }
                    if d.finish_reason is not None:
                        finals[i] = d
                        choice["stop_reason"] = self.reply.stop_reason(d.stop_reason, params)
                    if body.return_token_ids:
                        choice["token_ids"] = d.token_ids
                    yield event({**chunk_head, "choices": [choice], **chunk_usage(i)})
                if include_usage:
                    yield event({**chunk_head, "choices": [], "usage": usage(finals, n)})

            return StreamingResponse(sse(events()), media_type="text/event-stream")

        async def collect():
            gathered = await gather(deltas, n)
            choices = []
            for i, c in enumerate(gathered):
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.final.finish_reason,
                    "stop_reason": self.reply.stop_reason(c.final.stop_reason, params),
                }
                if body.logprobs:
                    choice["logprobs"] = self.reply.chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                if body.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            reply = {**head, "choices": choices, "usage": usage({i: c.final for i, c in enumerate(gathered)}, n)}
            if body.return_token_ids:  # the response's, as prompt_logprobs below
                reply["prompt_token_ids"] = ids
            if body.prompt_logprobs is not None:  # vLLM's place: the response's, one prompt for every choice
                reply["prompt_logprobs"] = self.reply.prompt_logprobs(ids, gathered[0].final)
            return reply

        return await self._unless_disconnected(request, collect())

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxserve",
            "max_model_len": self.handle.max_model_len,
        }

    async def responses(self, request: Request):
        """OpenAI's Responses API: the conversation as a chat, answered by one assistant
        message (``openai_responses``); streamed as OpenAI's events."""
        client, body = await self._accepted(request, ResponsesRequest)
        ids, params = await self._prepared(self.prepare.response, body)
        response_id = f"resp_{uuid.uuid4().hex[:24]}"
        engine_ids, queues = self._submit(response_id, [(ids, params)], client)
        build = ResponseBuilder(body, response_id, int(time.time()), self.model_name)
        deltas = self._deltas(engine_ids, queues)
        if body.stream:

            async def events():
                for opening in build.opening():
                    yield opening
                pieces, final = [], None
                try:
                    async for _, d in deltas:
                        if d.text:
                            pieces.append(d.text)
                            yield build.delta(d.text)
                        if d.finish_reason is not None:
                            final = d
                except APIError as e:
                    yield build.error(e.message)
                    return
                for closing in build.closing("".join(pieces), final):
                    yield closing

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect():
            (answer,) = await gather(deltas, 1)
            return build.response(answer.text, answer.final)

        return await self._unless_disconnected(request, collect())

    async def tokenize(self, request: Request) -> dict:
        self._client(request)
        body = await self._body(request, TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt, messages: give exactly one", param="prompt")

        def run():
            if body.messages is not None:
                return self.prepare.chat_ids(body)
            if not body.add_special_tokens:
                return self.prepare.encode(
                    self.handle.tokenizer.encode(body.prompt, add_special_tokens=False), "prompt"
                )
            return self.prepare.encode(body.prompt, "prompt")

        ids = await self._prepared(lambda _: run(), None)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.handle.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        self._client(request)
        body = await self._body(request, DetokenizeRequest)
        self._check_model(body.model)
        try:
            check_token_ids(body.tokens, self.handle.model_config.vocab_size, "tokens")
        except RequestError as e:
            raise bad_request(e) from None
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

    def _build(self, max_request_bytes: int) -> FastAPI:
        app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)

        def too_large(size: int):
            message = (
                f"the request body is {size} bytes or more; at most {max_request_bytes} (server.max_request_bytes)"
            )
            return self._refused("invalid_argument", APIError(413, message)).response()

        app.add_middleware(BodyLimit, limit=max_request_bytes, refuse=too_large)

        @app.exception_handler(APIError)
        async def api_error(request, e: APIError):
            return e.response()

        @app.exception_handler(StarletteHTTPException)
        async def no_route(request: Request, e: StarletteHTTPException):
            """An unknown path or method: OpenAI's error body (a client reads error.message),
            naming what is served, where FastAPI's {"detail": "Not Found"} said nothing."""
            if e.status_code not in (404, 405):
                return JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)
            try:
                self._client(request)  # with tokens configured, a stranger learns no routes
            except APIError as refused:
                return refused.response()
            routes = sorted(f"{m} {r.path}" for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD")
            message = f"no route {request.method} {request.url.path}; served: {', '.join(routes)}"
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            return APIError(e.status_code, message, type_=kind).response()

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.state() == "serving" else 503)

        # vLLM serves these on its API port: a scraper set up for it finds them here too.
        # With auth tokens they need one, as every route but /health (vLLM leaves them open;
        # an API port that asks strangers for a token should not tell them its load).
        @app.get("/metrics")
        async def metrics(request: Request):
            self._client(request)
            if self.metrics is None:
                raise APIError(404, "this server keeps no metrics", code="not_found")
            body, content_type = self.metrics.exposition()
            return Response(body, media_type=content_type)

        @app.get("/version")
        async def version(request: Request):
            self._client(request)
            return {"version": importlib.metadata.version("jaxserve")}

        @app.get("/v1/models")
        async def models(request: Request):
            self._client(request)
            return self.models()

        @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve)
        async def model(request: Request, model: str):
            self._client(request)
            self._check_model(model)
            return self.model_card()

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/responses")(self.responses)

        @app.get("/v1/responses/{response_id}")  # OpenAI's retrieve, delete and cancel: nothing is kept
        @app.delete("/v1/responses/{response_id}")
        @app.post("/v1/responses/{response_id}/cancel")
        async def stored_response(request: Request, response_id: str):
            self._client(request)
            shown = response_id if len(response_id) <= 40 else f"{response_id[:40]}..."
            raise APIError(
                404,
                f"response {shown!r}: this server keeps no responses (store is taken, nothing is kept)",
                param="response_id",
                type_="not_found_error",
            )

        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/tokenizer_info")(self.tokenizer_info)
        return app
