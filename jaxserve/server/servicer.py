"""The gRPC servicer: validates, hands requests to the engine thread, streams deltas back.

Validation (tokenizing, chat templates) runs on a small thread pool, never on the event
loop: a 1 MB prompt must not stall every other stream. A cancelled call (client cancel,
deadline, disconnect) aborts its request in the engine at the next step boundary, which
releases its pages. A request belongs to the client that submitted it (its identity or
peer): nobody else can abort it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import uuid

import grpc

from jaxserve.assembly import EngineHandle
from jaxserve.engine.async_engine import Delta, EngineStoppedError, EngineThread, QueueFullError, RequestIdInUseError
from jaxserve.errors import RequestError
from jaxserve.server.auth import TokenAuth, peer_identity
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import Metrics
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.submit import merged, sample_ids, submit_all
from jaxserve.server.validation import validate

MAX_DETAILS_CHARS = 1000  # status details travel as metadata: never echo a large input back
LARGE_REQUEST_BYTES = 64 * 1024

_LIVE_FIGURES = ("requests_waiting", "requests_running", "num_compiles", "leases") + tuple(
    f"kv_pages_{state}" for state in ("held", "cached", "free", "total", "pinned")
)
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def _fill(msg, delta: Delta) -> None:
    """Adds ``delta`` to ``msg``, but for its text (which the caller sets: adding a piece to
    a message's text copies the text so far, each step of a long unary answer)."""
    msg.token_ids.extend(delta.token_ids)
    msg.logprobs.extend(delta.logprobs)
    for top in delta.top_logprobs:
        msg.top_logprobs.add().entries.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top)
    if delta.finish_reason is not None:
        msg.finish_reason = FINISH[delta.finish_reason]
        if isinstance(delta.stop_reason, int):
            msg.stop_token_id = delta.stop_reason
        elif isinstance(delta.stop_reason, str):
            msg.stop_string = delta.stop_reason
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=delta.prompt_tokens,
                completion_tokens=delta.completion_tokens,
                cached_tokens=delta.cached_tokens,
            )
        )
        msg.lease_id = delta.lease_id or ""
        msg.pin_refused = delta.pin_refused
        if delta.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(float("nan") if lp is None else lp for lp in delta.prompt_logprobs)
            for top in delta.prompt_top_logprobs:
                msg.prompt_top_logprobs.add().entries.extend(
                    pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top or ()
                )


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(
        self,
        handle: EngineHandle,
        engine_thread: EngineThread,
        model_name: str,
        cfg: ServerConfig | None = None,
        auth: TokenAuth | None = None,
        metrics: Metrics | None = None,
    ):
        cfg = cfg or ServerConfig(metrics_port=None)
        self.handle = handle
        self.engine = engine_thread
        self.model_name = model_name
        self.auth = auth
        self.metrics = metrics or Metrics(lambda: engine_thread.snapshot)
        self.limits = cfg  # validate reads the prompt and max_tokens caps from it
        self.accepting = True
        self._ids = itertools.count()
        self._samples: dict[str, list[str]] = {}  # request id -> its samples' engine ids, while in flight
        # Off the event loop. Large prompts get their own worker, so a flood of them queues
        # behind itself and never ahead of small ones. (Measured with SmolLM2's tokenizer: a
        # 1 MB prompt's 1-2 s of tokenizing stretched another stream's longest token gap
        # from 199 to 258 ms; scripts/check_fairness.py.)
        self._validate_small = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-validate")
        self._validate_large = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-validate-large")

    def close(self) -> None:
        for pool in (self._validate_small, self._validate_large):
            pool.shutdown(wait=False, cancel_futures=True)

    def client(self, context) -> str:
        """Who is calling: the token's identity (the interceptor has checked it), or the peer."""
        if self.auth is not None:
            identity = self.auth.identity(context.invocation_metadata())
            if identity is not None:
                return f"id:{identity}"
        return peer_identity(context)

    async def _refuse(self, context, code: grpc.StatusCode, reason: str, message: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        if len(message) > MAX_DETAILS_CHARS:
            message = f"{message[:MAX_DETAILS_CHARS]}... (cut at {MAX_DETAILS_CHARS} characters)"
        await context.abort(code, message)

    async def _start(self, request: pb.GenerateRequest, context) -> tuple[str, asyncio.Queue]:
        if not self.accepting:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "shutting_down", "the server is shutting down")
        loop = asyncio.get_running_loop()
        pool = self._validate_large if request.ByteSize() > LARGE_REQUEST_BYTES else self._validate_small
        pin_s = request.pin_s if request.HasField("pin_s") else None
        try:
            ids, params = await loop.run_in_executor(pool, validate, request, self.handle, self.limits)
        except RequestError as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e))
        request_id = request.request_id or f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        # n > 1: one engine request per sample ("id", "id#1", ...), all submitted at once.
        engine_ids = sample_ids(request_id, params.n)
        jobs = [(i, ids, sample) for i, sample in zip(engine_ids, params.samples(), strict=True)]
        try:
            queues = submit_all(self.engine, jobs, self.client(context), pin_s)
            self._samples[request_id] = engine_ids
            return request_id, queues
        except RequestError as e:  # a pin_s the engine cannot give
            error = (grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e))
        except QueueFullError as e:
            error = (grpc.StatusCode.RESOURCE_EXHAUSTED, e.reason, str(e))
        except EngineStoppedError as e:
            error = (grpc.StatusCode.UNAVAILABLE, "shutting_down", str(e))
        except RequestIdInUseError as e:
            error = (grpc.StatusCode.ALREADY_EXISTS, "request_id_in_use", str(e))
        await self._refuse(context, *error)

    async def _deltas(self, request_id: str, queues: list[asyncio.Queue], context):
        """(sample index, delta) of every sample as they come, until each has finished."""
        try:
            async for i, delta in merged(queues):
                if delta.error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, delta.error)
                yield i, delta
        finally:
            # Cancelled (client gone, deadline) or closed early: free the engine's pages.
            for sample_id in self._samples.pop(request_id, [request_id]):
                self.engine.abort(sample_id)

    async def StreamGenerate(self, request, context):
        request_id, queues = await self._start(request, context)
        async for i, delta in self._deltas(request_id, queues, context):
            msg = pb.GenerateStreamResponse(request_id=request_id, index=i, text=delta.text)
            _fill(msg, delta)
            yield msg

    async def Generate(self, request, context):
        request_id, queues = await self._start(request, context)
        samples = [pb.GenerateResponse(request_id=request_id) for _ in queues]
        texts: list[list[str]] = [[] for _ in queues]
        async for i, delta in self._deltas(request_id, queues, context):
            _fill(samples[i], delta)
            texts[i].append(delta.text)
        for sample, pieces in zip(samples, texts, strict=True):
            sample.text = "".join(pieces)
        msg = samples[0]
        if len(samples) > 1:
            msg.samples.extend(samples)
        return msg

    async def GetModelInfo(self, request, context):
        cfg, mcfg, plan = self.handle.config, self.handle.model_config, self.handle.plan
        return pb.ModelInfo(
            model=self.model_name,
            model_type=mcfg.model_type,
            max_model_len=plan.max_model_len,
            vocab_size=mcfg.vocab_size,
            dtype=plan.dtype,
            page_size=cfg.page_size,
            num_pages=plan.num_pages,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )

    async def Abort(self, request, context):
        client = self.client(context)
        found = [
            self.engine.abort(i, client=client) for i in self._samples.get(request.request_id, [request.request_id])
        ]
        return pb.AbortResponse(found=any(found))

    async def Unpin(self, request, context):
        lease_id, client = request.lease_id, self.client(context)
        loop = asyncio.get_running_loop()
        try:  # on the engine thread, between steps; waited for off the event loop
            found = await loop.run_in_executor(None, self.engine.call, lambda e: e.unpin(lease_id, client))
        except EngineStoppedError as e:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "shutting_down", str(e))
        return pb.UnpinResponse(found=bool(found))

    async def GetServerStats(self, request, context):
        s = self.engine.snapshot
        rejected = {
            sample.labels["reason"]: int(sample.value)
            for metric in self.metrics.rejected.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }
        return pb.ServerStats(
            **{name: s.get(name, 0) for name in _LIVE_FIGURES},  # the snapshot's names are the wire's
            requests_aborted={k[len("aborted_") :]: v for k, v in s.items() if k.startswith("aborted_")},
            requests_rejected=rejected,
        )
