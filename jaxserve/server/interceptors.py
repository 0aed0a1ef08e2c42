"""Server interceptors: who may call (bearer tokens), and request bodies that do not parse.

Both act before a method runs. ``AuthInterceptor`` answers UNAUTHENTICATED to calls
without a known token (health checks stay open: they reveal nothing). ``DecodeInterceptor``
parses the service's request bodies itself, so a body that is not the message answers
INVALID_ARGUMENT (gRPC's own deserializer failure reads as UNKNOWN to the client).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from jaxserve.server.auth import TokenAuth

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _same_kind(handler, unary, stream, **serializers):
    """A handler of ``handler``'s kind (unary or server-streaming response)."""
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **serializers)
    return grpc.unary_unary_rpc_method_handler(unary, **serializers)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED, before the method runs, to calls without a known token."""

    def __init__(self, auth: TokenAuth):
        self.auth = auth

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        if self.auth.identity(details.invocation_metadata) is not None:
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token (authorization)")

        async def deny_stream(request, context):
            await deny(request, context)
            yield  # pragma: no cover - abort raised

        if handler.request_streaming:  # reflection: a stream of requests
            factory = (
                grpc.stream_stream_rpc_method_handler
                if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            return factory(deny_stream if handler.response_streaming else deny)
        # No request deserializer: an unauthenticated body is never parsed.
        return _same_kind(handler, deny, deny_stream, response_serializer=handler.response_serializer)


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """Parses ``service``'s unary request bodies; INVALID_ARGUMENT when one does not parse."""

    def __init__(self, service: str, request_types: dict[str, type]):
        self.prefix = f"/{service}/"
        self.request_types = request_types  # method name -> request message class

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix) or handler.request_streaming:
            return handler
        message_type = self.request_types[details.method[len(self.prefix) :]]

        async def parse(raw: bytes, context):
            try:
                return message_type.FromString(raw)
            except (DecodeError, RuntimeError, ValueError) as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request body is not a valid {message_type.DESCRIPTOR.full_name} ({type(e).__name__})",
                )

        async def unary(raw, context):
            return await handler.unary_unary(await parse(raw, context), context)

        async def stream(raw, context):
            async for item in handler.unary_stream(await parse(raw, context), context):
                yield item

        return _same_kind(handler, unary, stream, response_serializer=handler.response_serializer)
