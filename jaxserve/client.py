"""A small Python client for the jaxserve gRPC service.

from jaxserve.client import Client
with Client("127.0.0.1:50051") as c:
    print(c.generate("What is the capital of France?", max_tokens=32, temperature=0).text)
    for piece in c.stream([{"role": "user", "content": "Tell me a joke."}]):
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.errors import RequestError
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc


def build_request(
    prompt,
    request_id: str = "",
    pin_s: float | None = None,
    truncate_prompt_tokens: int | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    chat_template_kwargs: dict | None = None,
    **sampling,
) -> pb.GenerateRequest:
    """A GenerateRequest from a text, a token-id list or chat messages, and sampling fields
    (None: not set); ``pin_s``: pin the finished request's tokens in the prefix cache that
    long (a lease); ``truncate_prompt_tokens``: compute only the prompt's last k tokens
    (-1: as many as the context holds). A chat's ``add_generation_prompt``,
    ``continue_final_message`` and ``chat_template_kwargs`` are vLLM's (ChatMessages). A
    value the wire cannot carry is a RequestError naming its field (the server checks the
    rest)."""
    req = pb.GenerateRequest(request_id=request_id)
    if pin_s is not None:
        _assign(req, "pin_s", pin_s, "")
    if truncate_prompt_tokens is not None:
        _assign(req, "truncate_prompt_tokens", truncate_prompt_tokens, "")
    chat = isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt)
    if not chat and (add_generation_prompt, continue_final_message, chat_template_kwargs) != (None, None, None):
        raise RequestError(
            "add_generation_prompt, continue_final_message and chat_template_kwargs: for a chat prompt only "
            "(a list of {role, content} messages)"
        )
    if isinstance(prompt, str):
        req.text = prompt
    elif chat:
        for i, m in enumerate(prompt):
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise RequestError(f"prompt[{i}]: a chat message needs a string 'role' and 'content'")
            req.chat.messages.append(pb.ChatMessage(role=m["role"], content=m["content"]))
        if add_generation_prompt is not None:
            _assign(req.chat, "add_generation_prompt", add_generation_prompt, "chat.")
        if continue_final_message is not None:
            _assign(req.chat, "continue_final_message", continue_final_message, "chat.")
        if chat_template_kwargs is not None:
            try:
                req.chat.chat_template_kwargs = json.dumps(chat_template_kwargs)
            except (TypeError, ValueError) as e:
                raise RequestError(f"chat_template_kwargs: not JSON-serializable ({e})") from None
    elif isinstance(prompt, (list, tuple)):
        _assign(req.token_ids, "ids", prompt, "prompt.")
    else:
        raise RequestError(
            f"prompt: a string, a list of token ids or a list of chat messages; got a {type(prompt).__name__}"
        )
    for name, value in sampling.items():
        if value is not None:
            _assign(req.sampling_params, name, value, "sampling_params.")
    return req


def _assign(msg, name: str, value, path: str) -> None:
    """``msg.name = value`` (extended for a list, updated for a map), or a RequestError
    naming ``path + name``: protobuf's own errors name no field."""
    fields = msg.DESCRIPTOR.fields_by_name
    field = fields.get(name)
    if field is None:
        raise RequestError(f"{path}{name}: no such field; allowed: {', '.join(sorted(fields))}")
    try:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(msg, name).update(value)
        elif field.is_repeated:
            getattr(msg, name).extend([value] if isinstance(value, str) else value)
        else:
            setattr(msg, name, value)
    except (TypeError, ValueError) as e:
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:80]}..."
        raise RequestError(f"{path}{name} = {shown}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Credentials:
    """How to reach a server that has TLS (``root_certificates``: the CA's PEM), mutual
    TLS (also the client's key and certificate) or token authentication (``token``)."""

    token: str | None = None
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def open_channel(address: str, credentials: Credentials | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS when ``credentials.root_certificates`` is given."""
    if credentials is None or credentials.root_certificates is None:
        return grpc.insecure_channel(address)
    tls = grpc.ssl_channel_credentials(
        credentials.root_certificates, credentials.private_key, credentials.certificate_chain
    )
    return grpc.secure_channel(address, tls)


class Client:
    def __init__(self, address: str, credentials: Credentials | None = None):
        self.credentials = credentials or Credentials()
        self.channel = open_channel(address, credentials)
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self._md = self.credentials.metadata

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, prompt, timeout: float | None = None, **sampling) -> pb.GenerateResponse:
        return self.stub.Generate(build_request(prompt, **sampling), timeout=timeout, metadata=self._md)

    def stream(self, prompt, timeout: float | None = None, **sampling) -> Iterator[pb.GenerateStreamResponse]:
        """The streamed deltas; the iterator is the call, so ``.cancel()`` aborts the request."""
        return self.stub.StreamGenerate(build_request(prompt, **sampling), timeout=timeout, metadata=self._md)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._md)

    def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return self.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=timeout, metadata=self._md)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._md).found

    def pin(self, prompt, ttl_s: float = 60.0, timeout: float | None = None) -> pb.GenerateResponse:
        """Computes ``prompt`` as a prefill-only request and pins it for ``ttl_s`` seconds:
        the response's ``lease_id`` (or, refused, ``pin_refused``) and its usage."""
        return self.generate(prompt, timeout=timeout, max_tokens=0, pin_s=ttl_s)

    def unpin(self, lease_id: str) -> bool:
        """Ends a lease of this client's now; False if it has ended or expired (or is not ours)."""
        return self.stub.Unpin(pb.UnpinRequest(lease_id=lease_id), metadata=self._md).found


def wait_until_serving(
    address: str,
    timeout: float = 600,
    service: str = "",
    is_alive: Callable[[], bool] | None = None,
    credentials: Credentials | None = None,
) -> None:
    """Polls the standard health service until ``address`` reports SERVING.

    Raises TimeoutError after ``timeout`` seconds, or RuntimeError as soon as ``is_alive``
    (e.g. a server process's liveness) returns False.
    """
    deadline = time.monotonic() + timeout
    with open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if is_alive is not None and not is_alive():
                raise RuntimeError(f"the server at {address} exited before SERVING")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING after {timeout}s")
