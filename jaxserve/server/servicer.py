"""The gRPC servicer: validates, hands requests to the engine thread, streams deltas back.

A cancelled call (client cancel, deadline, disconnect) aborts its request in the engine
at the next step boundary, which releases its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import grpc

from jaxserve.engine.async_engine import Delta, EngineThread, QueueFullError
from jaxserve.errors import JaxServeError, RequestError
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.validation import validate

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def _fill(msg, delta: Delta) -> None:
    msg.token_ids.extend(delta.token_ids)
    msg.text += delta.text
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


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, llm, engine_thread: EngineThread, model_name: str):
        self.llm = llm
        self.engine = engine_thread
        self.model_name = model_name
        self.accepting = True
        self._ids = itertools.count()

    async def _start(self, request: pb.GenerateRequest, context) -> tuple[str, asyncio.Queue]:
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        try:
            ids, params = validate(request, self.llm)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        try:
            return request_id, self.engine.submit(request_id, ids, params)
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except JaxServeError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))

    async def _deltas(self, request_id: str, q: asyncio.Queue, context):
        try:
            while True:
                delta = await q.get()
                if delta.error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, delta.error)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            # Cancelled (client gone, deadline) or closed early: free the engine's pages.
            self.engine.abort(request_id)

    async def StreamGenerate(self, request, context):
        request_id, q = await self._start(request, context)
        async for delta in self._deltas(request_id, q, context):
            msg = pb.GenerateStreamResponse(request_id=request_id)
            _fill(msg, delta)
            yield msg

    async def Generate(self, request, context):
        request_id, q = await self._start(request, context)
        msg = pb.GenerateResponse(request_id=request_id)
        async for delta in self._deltas(request_id, q, context):
            _fill(msg, delta)
        return msg

    async def GetModelInfo(self, request, context):
        cfg, mcfg = self.llm.config, self.llm.model_config
        return pb.ModelInfo(
            model=self.model_name,
            model_type=mcfg.model_type,
            max_model_len=self.llm.max_model_len,
            vocab_size=mcfg.vocab_size,
            dtype=self.llm.dtype,
            page_size=cfg.page_size,
            num_pages=self.llm.pool.num_pages,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )

    async def Abort(self, request, context):
        return pb.AbortResponse(found=self.engine.abort(request.request_id))
