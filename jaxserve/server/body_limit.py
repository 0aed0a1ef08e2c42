"""The HTTP API's cap on a request body, before anything parses it.

Without it a body is read whole and parsed on the event loop: 20M token ids (a 60 MB body)
took a tiny test server (its client in the same process) from 572 to 3351 MiB and 24 s,
every stream waiting, before the prompt was refused for its length; a few hundred MB would end
in the OOM killer. gRPC has the same cap on a message (``server.max_request_bytes``, its
``grpc.max_receive_message_length``). The default, 16 MiB, still takes a 1M-character
prompt (``max_prompt_chars``) with every character JSON-escaped.

A declared ``Content-Length`` over the cap is refused without reading the body; a chunked
body is read up to the cap and refused once it passes it. Either way the answer is 413
with OpenAI's error body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: bodies of at most ``limit`` bytes reach ``app``; ``refuse(size)``
    (size: the declared length, or the bytes read so far, a lower bound) answers the rest."""

    def __init__(self, app, limit: int, refuse: Callable[[int], Any]):
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:  # the server reads exactly this many bytes (it rejects a bad value itself)
            size = int(declared)
            if size > self.limit:
                await self.refuse(size)(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        # Chunked: read it here, up to the limit, and hand the app the whole body at once.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self.refuse(size)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            return pending.pop() if pending else await receive()  # after the body: disconnect watches

        await self.app(scope, replay, send)
