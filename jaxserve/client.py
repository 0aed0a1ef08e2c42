"""A small Python client for the jaxserve gRPC service.

from jaxserve.client import Client
with Client("127.0.0.1:50051") as c:
    print(c.generate("What is the capital of France?", max_tokens=32, temperature=0).text)
    for piece in c.stream([{"role": "user", "content": "Tell me a joke."}]):
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def wait_until_serving(
    address: str, timeout: float = 600, service: str = "", is_alive: Callable[[], bool] | None = None
) -> None:
    """Polls the standard health service until ``address`` reports SERVING.

    Raises TimeoutError after ``timeout`` seconds, or RuntimeError as soon as ``is_alive``
    (e.g. a server process's liveness) returns False.
    """
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
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
