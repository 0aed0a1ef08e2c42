"""A small Python client for the jaxserve gRPC service.

from jaxserve.client import Client
with Client("127.0.0.1:50051") as c:
    print(c.generate("What is the capital of France?", max_tokens=32, temperature=0).text)
    for piece in c.stream([{"role": "user", "content": "Tell me a joke."}]):
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc


def build_request(prompt, request_id: str = "", **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a text, a token-id list or chat messages, and sampling fields."""
    req = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    stop = sampling.pop("stop", None) or ()
    stop_ids = sampling.pop("stop_token_ids", None) or ()
    req.sampling_params.CopyFrom(pb.SamplingParams(**sampling))
    req.sampling_params.stop.extend([stop] if isinstance(stop, str) else stop)
    req.sampling_params.stop_token_ids.extend(stop_ids)
    return req


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.JaxServeStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, prompt, timeout: float | None = None, **sampling) -> pb.GenerateResponse:
        return self.stub.Generate(build_request(prompt, **sampling), timeout=timeout)

    def stream(self, prompt, timeout: float | None = None, **sampling) -> Iterator[pb.GenerateStreamResponse]:
        yield from self.stub.StreamGenerate(build_request(prompt, **sampling), timeout=timeout)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest())

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id)).found
