"""What the gRPC and HTTP front ends share between validating a request and answering it:
submitting its samples to the engine thread together, and reading their deltas as they
come. Transport-free: each front end maps the errors to its own status codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from jaxserve.engine.async_engine import Delta, EngineThread
from jaxserve.sampling_params import SamplingParams


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's n samples: ``id``, ``id#1``, ..."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


def submit_all(
    engine: EngineThread,
    jobs: Sequence[tuple[str, list[int], SamplingParams]],
    client: str,
    pin_s: float | None = None,
) -> list[asyncio.Queue]:
    """Submits every ``(engine id, prompt ids, params)`` job, in order; returns their delta
    queues. All or none: if one is refused (RequestError, QueueFullError,
    EngineStoppedError, RequestIdInUseError), the ones already in are aborted and the
    error is raised."""
    queues = []
    try:
        for engine_id, ids, params in jobs:
            queues.append(engine.submit(engine_id, ids, params, client=client, pin_s=pin_s))
    except Exception:
        for engine_id, _, _ in jobs[: len(queues)]:
            engine.abort(engine_id)
        raise
    return queues


async def merged(queues: Sequence[asyncio.Queue]) -> AsyncIterator[tuple[int, Delta]]:
    """(job index, delta) of every job as they come, until each has its final delta.
    Deltas that piled up while the reader was busy come as one (``Delta.absorb``): a loaded
    server answers a stream once per wake-up, not once per token. A delta with ``error`` is
    yielded on its own, like any other (its job has ended)."""
    if len(queues) == 1:  # the ordinary call: read it directly, no task per delta
        while True:
            for delta in _gathered(await queues[0].get(), queues[0]):
                yield 0, delta
                if delta.is_last:
                    return
    getters = {asyncio.ensure_future(q.get()): i for i, q in enumerate(queues)}
    try:
        while getters:
            done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = getters.pop(future)
                for delta in _gathered(future.result(), queues[i]):
                    yield i, delta
                if not delta.is_last:
                    getters[asyncio.ensure_future(queues[i].get())] = i
    finally:
        for future in getters:
            future.cancel()


def _gathered(first: Delta, deltas: asyncio.Queue) -> list[Delta]:
    """``first`` with whatever already waits behind it absorbed: one delta, or two when the
    second carries an error (never merged, so the tokens before it are answered first)."""
    while not first.is_last and not deltas.empty():
        later = deltas.get_nowait()
        if later.error is not None:
            return [first, later]
        first.absorb(later)
    return [first]
