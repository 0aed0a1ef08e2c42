"""A bounded soak against a running server: Poisson arrivals of requests that complete,
get cancelled, run out their deadline, lose their connection, abort themselves or are
malformed, mixed at random. Every call's outcome is checked against what its kind must
produce; anything else is an unexpected error.

CI runs a short version (tests/test_soak.py). The long version, against the default model::

    python -m tests.soak --minutes 10                      # configs/smollm2-135m.yaml
    python -m tests.soak --minutes 10 --config configs/test-tiny.yaml --set model=PATH

It prints the counts per kind, the unexpected errors, the server's live figures after the
run (pages left held among them), integrity failures after steps, compiles after warm-up,
and the server's RSS at the start, middle and end (flat memory: the end near the middle).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time

import grpc

from jaxserve.client import build_request
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

KINDS = ("complete", "stream", "cancel", "deadline", "disconnect", "self_abort", "bad")
BUSY = {grpc.StatusCode.RESOURCE_EXHAUSTED}  # a full queue is an honest answer under load
BAD_REQUESTS = (
    dict(temperature=-1.0),
    dict(top_p=0.0),
    dict(top_k=-2),
    dict(min_p=2.0),
    dict(logprobs=99),
    dict(temperature=float("nan")),
    dict(max_tokens=10**9),
    dict(stop=[""]),
)


@dataclasses.dataclass
class SoakReport:
    counts: dict[str, int]
    busy: int
    unexpected: list[str]
    seconds: float


def rss_bytes() -> int:
    """This process's resident memory (the soak runs the server in process)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


LONG = 512  # max_tokens of calls meant to be cut short: they must not end on their own first


async def _one(
    addr: str, kind: str, rng: random.Random, vocab: int, max_tokens: int, context: int, unexpected: list
) -> bool:
    """Runs one call of ``kind``; returns False if the server was busy (RESOURCE_EXHAUSTED).
    Prompt and output fit ``context`` (the server's max_model_len): only ``bad`` calls are
    meant to be refused."""
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max(1, min(48, context // 4))))]
    room = context - len(prompt)
    n = rng.randint(1, min(max_tokens, room))
    long = min(LONG, room)
    sampling = dict(max_tokens=n, temperature=rng.choice([0.0, 0.7, 1.0]), ignore_eos=True, seed=rng.randrange(1000))
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.JaxServeStub(channel)
        try:
            if kind == "complete":
                reply = await stub.Generate(build_request(prompt, **sampling), timeout=300)
                if len(reply.token_ids) != n or reply.finish_reason != pb.FINISH_REASON_LENGTH:
                    unexpected.append(f"complete: {len(reply.token_ids)} of {n} tokens, finish {reply.finish_reason}")
            elif kind == "stream":
                got = 0
                async for msg in stub.StreamGenerate(build_request(prompt, **sampling), timeout=300):
                    got += len(msg.token_ids)
                if got != n:
                    unexpected.append(f"stream: {got} of {n} tokens")
            elif kind in ("cancel", "disconnect"):
                call = stub.StreamGenerate(build_request(prompt, **dict(sampling, max_tokens=long)))
                want = rng.randint(1, 3)
                async for _ in call:
                    want -= 1
                    if want == 0:
                        break
                if kind == "cancel":
                    call.cancel()
                else:
                    await channel.close(grace=None)  # the connection goes, not just the call
            elif kind == "deadline":
                try:
                    await stub.Generate(build_request(prompt, **dict(sampling, max_tokens=long)), timeout=0.05)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, *BUSY):
                        unexpected.append(f"deadline: {e.code().name}: {e.details()[:200]}")
            elif kind == "self_abort":
                request_id = f"soak-{rng.getrandbits(64):x}"
                call = stub.StreamGenerate(build_request(prompt, request_id, **dict(sampling, max_tokens=long)))
                last = None
                async for msg in call:
                    if last is None:
                        found = (await stub.Abort(pb.AbortRequest(request_id=request_id), timeout=60)).found
                        if not found:
                            unexpected.append("self_abort: the server did not find our own request")
                    last = msg
                if last is not None and last.finish_reason not in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_LENGTH):
                    unexpected.append(f"self_abort: finish {last.finish_reason}")
            elif kind == "bad":
                try:
                    await stub.Generate(build_request(prompt, **dict(sampling, **rng.choice(BAD_REQUESTS))), timeout=60)
                    unexpected.append("bad: a malformed request was accepted")
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        unexpected.append(f"bad: {e.code().name}: {e.details()[:200]}")
        except grpc.aio.AioRpcError as e:
            if e.code() in BUSY:
                return False
            if not (kind in ("cancel", "disconnect") and e.code() == grpc.StatusCode.CANCELLED):
                unexpected.append(f"{kind}: {e.code().name}: {e.details()[:200]}")
    return True


async def soak(
    addr: str, seconds: float, rate: float, vocab: int, max_tokens: int = 24, seed: int = 0, context: int = 8192
) -> SoakReport:
    """Poisson arrivals at ``rate`` per second for ``seconds``; waits for every call.
    ``context``: the server's max_model_len."""
    rng = random.Random(seed)
    counts = {k: 0 for k in KINDS}
    unexpected: list[str] = []
    busy = 0
    tasks = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        kind = rng.choice(KINDS)
        counts[kind] += 1
        tasks.append(
            asyncio.create_task(
                _one(addr, kind, random.Random(rng.getrandbits(64)), vocab, max_tokens, context, unexpected)
            )
        )
        await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            unexpected.append(f"client side: {type(r).__name__}: {r}")
        elif r is False:
            busy += 1
    return SoakReport(counts, busy, unexpected, time.monotonic() - start)


def wait_idle(server, timeout: float = 120) -> dict:
    """The engine thread's figures once no request runs or waits."""

    def idle():
        snap = server.engine_thread.snapshot
        quiet = snap.get("requests_running") == 0 and snap.get("requests_waiting") == 0
        return snap if quiet and not server.engine_thread.num_active else None

    detail = lambda: server.engine_thread.snapshot  # noqa: E731
    return wait_until(idle, "no request in flight after the soak", timeout, detail=detail)


def check_every_step(server) -> list[str]:
    """Runs the scheduler's integrity check after every step (on the engine thread);
    returns the list its failures are appended to."""
    failures: list[str] = []
    on_step = server.engine_thread.on_step

    def checked(thread, advanced, finished, now):
        try:
            thread.engine.scheduler.check_integrity()
        except AssertionError as e:
            failures.append(str(e))
        if on_step is not None:
            on_step(thread, advanced, finished, now)

    server.engine_thread.on_step = checked
    return failures


def main() -> None:
    from jaxserve.llm import LLM
    from jaxserve.server.config import load_run_config
    from jaxserve.server.server import Server, ServerHandle

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    engine_cfg, server_cfg = load_run_config(args.config, [*args.set, "server.port=0", "server.metrics_port=null"])
    llm = LLM(config=engine_cfg, progress=False, warmup=False)  # the server warms up
    server = Server(llm.handle, server_cfg, engine_cfg.model, progress=False)
    failures = check_every_step(server)
    handle = ServerHandle(server)
    addr = f"127.0.0.1:{handle.start()}"
    from jaxserve.client import wait_until_serving

    wait_until_serving(addr, timeout=1800)
    compiles = server.engine_thread.call(lambda e: e.runner.num_compiles)
    half = args.minutes * 30
    rss = [rss_bytes()]
    reports = []
    for i in range(2):
        vocab, context = llm.model_config.vocab_size, llm.max_model_len
        reports.append(asyncio.run(soak(addr, half, args.rate, vocab, args.max_tokens, seed=i, context=context)))
        snap = wait_idle(server)
        rss.append(rss_bytes())
    handle.stop()
    mib = [r / 2**20 for r in rss]
    for i, r in enumerate(reports):
        print(f"half {i + 1}: {r.seconds:.0f} s, calls {r.counts}, busy {r.busy}, unexpected {len(r.unexpected)}")
        for line in r.unexpected[:20]:
            print("  unexpected:", line)
    print(f"after: {snap}")
    print(f"integrity failures after steps: {len(failures)}")
    print(f"compiles: {compiles} in warm-up, {snap['num_compiles'] - compiles} after")
    print(f"server RSS MiB: start {mib[0]:.0f}, after half 1 {mib[1]:.0f}, after half 2 {mib[2]:.0f}")


if __name__ == "__main__":
    main()
