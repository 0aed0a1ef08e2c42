"""A load generator with serving metrics, against a running server (like vLLM's and
SGLang's serving benchmarks): jaxserve's gRPC API (``--server host:port``), or any
OpenAI-compatible HTTP server (``--server http://host:port``: streaming ``/v1/completions``
with token-id prompts and vLLM's ``ignore_eos``), so one client measures jaxserve and vLLM
alike. Over HTTP an inter-token latency is the gap between streamed chunks that carry
text, and the output tokens are the final usage chunk's count.

Workloads (token-id prompts, EOS ignored so output lengths are exact):
  random                    prompt / output lengths drawn uniformly from ranges
  shared-prefix             G system prompts x Q questions each (SGLang's generated-shared-prefix)
  long-prompt-interference  steady decode streams plus a long prompt every --interval seconds
                            (its load: not bounded by --concurrency, no sweep); ITL is
                            reported for the steady streams alone
  multi-turn                conversations that resend their history each turn
Load: a fixed --concurrency, or Poisson arrivals at --request-rate (requests/s); a list of
either (``--concurrency 1,4,16``) sweeps it, one run per value (each with its own prompts,
so the prefix cache does not carry one run into the next).
Reports TTFT, inter-token latency, TPOT and end-to-end latency (p50/p90/p99), output and
total throughput, prefix-cache hit rate; prints a table, writes JSON with --json (also every
request: when it was sent, its TTFT, its inter-token gaps, as vLLM's saved results) and a
picture with --plot (a sweep: curves against load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import sys
import time

import grpc
import numpy as np
from tqdm.auto import tqdm

from jaxserve.bench import at_least, footer, output_file, plot, positive_seconds, span
from jaxserve.client import build_request
from jaxserve.errors import ConfigError
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc

WORKLOADS = ("random", "shared-prefix", "long-prompt-interference", "multi-turn")


@dataclasses.dataclass
class Result:
    tag: str  # "main", or "steady" / "long" in the interference workload
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say (vLLM's without --enable-prompt-tokens-details)
    ttft: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    sent: float = 0.0  # perf_counter() when the request went out


class GrpcTarget:
    """jaxserve's gRPC API: every streamed message carries its token ids."""

    multi_turn = True  # the replies' token ids come back, to extend a conversation's history

    def __init__(self, address: str):
        self.address = address

    async def __aenter__(self):
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = pb_grpc.JaxServeStub(self._channel)
        try:  # one clear error for no server there, not a report of every request failing
            await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        except grpc.aio.AioRpcError as e:
            await self._channel.close()
            raise ConfigError(
                f"--server {self.address}: the jaxserve gRPC API does not answer ({e.code().name}: {e.details()})"
            ) from None
        return self

    async def __aexit__(self, *exc):
        await self._channel.close()

    async def stream(self, res: Result, ids: list[int], max_tokens: int, timeout: float):
        """Yields at each message that brings tokens; fills res's tokens and cached count."""
        try:
            call = self._stub.StreamGenerate(
                build_request(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True), timeout=timeout
            )
            async for msg in call:
                if msg.finish_reason:
                    res.cached_tokens = msg.usage.cached_tokens
                if msg.token_ids:
                    res.output_ids.extend(msg.token_ids)
                    res.output_tokens = len(res.output_ids)
                    yield
        except grpc.aio.AioRpcError as e:
            res.error = f"{e.code().name}: {e.details()}"


class OpenAITarget:
    """An OpenAI-compatible HTTP server (vLLM's, SGLang's, jaxserve's own): streaming
    completions of token-id prompts, EOS ignored (vLLM's extra field).

    aiohttp, as vLLM's and SGLang's serving benchmarks use: httpx's connection pool asks
    every open connection whether it has expired (a ``getpeername`` each) for every new
    request, so at 64 streams this client spent most of its core there and requests
    waited ~0.65 s for it before the server saw them, which the report showed as the
    server's time to first token."""

    multi_turn = False  # completions stream text, not the token ids a history needs

    def __init__(self, url: str, model: str | None):
        self.url, self.model = url.rstrip("/"), model

    async def __aenter__(self):
        import aiohttp  # (only here: gRPC runs never load it)

        self._errors = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)
        self._timeout = aiohttp.ClientTimeout
        # limit=0: as many connections as requests in flight, each kept for the next request
        # while idle under 3 s: uvicorn's default (vLLM's and SGLang's HTTP servers) closes
        # one idle for 5 s, and a request sent on it as it closes fails ("connection reset");
        # jaxserve's keeps one server.http_keep_alive_seconds (75 s).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout())
        if self.model is None:  # the server's first (usually only) model
            try:
                async with self._session.get(f"{self.url}/v1/models", timeout=self._timeout(total=30)) as reply:
                    reply.raise_for_status()
                    self.model = (await reply.json())["data"][0]["id"]
            except (*self._errors, KeyError, IndexError, TypeError) as e:
                await self._session.close()
                raise ConfigError(f"--server {self.url}: no model listed at /v1/models ({e}); pass --model") from None
        return self

    async def __aexit__(self, *exc):
        await self._session.close()

    async def stream(self, res: Result, ids: list[int], max_tokens: int, timeout: float):
        """Yields at each streamed chunk that brings text; fills res from the usage chunk."""
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"{self.url}/v1/completions"
        try:
            async with self._session.post(url, json=body, timeout=self._timeout(total=timeout)) as reply:
                if reply.status != 200:
                    res.error = f"HTTP {reply.status}: {(await reply.read()).decode(errors='replace')[:200]}"
                    return
                async for raw in reply.content:  # one line at a time
                    line = raw.decode().rstrip("\r\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        res.cached_tokens = details.get("cached_tokens")
                    if any(c.get("text") for c in chunk.get("choices", ())):
                        yield
        except self._errors as e:
            res.error = f"{type(e).__name__}: {e}"


def target(args) -> GrpcTarget | OpenAITarget:
    """The server to load: an http(s):// URL speaks OpenAI's HTTP API, anything else is gRPC."""
    if args.server.startswith(("http://", "https://")):
        return OpenAITarget(args.server, args.model)
    if args.model is not None:
        raise ConfigError("--model names the model of an OpenAI-compatible --server http://...; gRPC serves one")
    return GrpcTarget(args.server)


async def _one(server, ids: list[int], max_tokens: int, tag: str, timeout: float) -> Result:
    res = Result(tag, prompt_tokens=len(ids))
    t0 = res.sent = time.perf_counter()
    last = None
    async for _ in server.stream(res, ids, max_tokens, timeout):
        now = time.perf_counter()
        if last is None:
            res.ttft = now - t0
        else:
            res.itls.append(now - last)
        last = now
    res.e2e = time.perf_counter() - t0
    return res


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    a = np.asarray(values)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }


def _hit_rate(rs: list[Result]) -> float | None:
    """Cached prompt tokens / prompt tokens over the requests whose server said how many
    were cached; None where none said (a rate of 0 would claim a cache that found nothing)."""
    told = [r for r in rs if r.cached_tokens is not None]
    return sum(r.cached_tokens for r in told) / max(sum(r.prompt_tokens for r in told), 1) if told else None


def hit_rate_text(rate: float | None) -> str:
    return "n/a (the server reports no cached tokens)" if rate is None else f"{rate:.1%}"


def summarize(results: list[Result], seconds: float, tag: str | None = None) -> dict:
    rs = [r for r in results if r.error is None and (tag is None or r.tag == tag)]
    out_tokens = sum(r.output_tokens for r in rs)
    prompt_tokens = sum(r.prompt_tokens for r in rs)
    return {
        "requests": len(rs),
        "errors": sum(r.error is not None for r in results if tag is None or r.tag == tag),
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / seconds,
        "total_throughput": (out_tokens + prompt_tokens) / seconds,
        "prefix_cache_hit_rate": _hit_rate(rs),
        "ttft_s": _pct([r.ttft for r in rs if r.output_tokens]),
        "itl_s": _pct([x for r in rs for x in r.itls]),
        "tpot_s": _pct([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in rs if r.output_tokens > 1]),
        "e2e_s": _pct([r.e2e for r in rs]),
    }


async def run_bench(args) -> dict:
    """One run at one load: ``args.concurrency`` an int, ``args.request_rate`` a float."""
    rng = random.Random(args.seed)
    vocab = args.vocab
    (in_lo, in_hi), (out_lo, out_hi) = args.input_len, args.output_len

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    server = target(args)
    if args.workload == "multi-turn" and not server.multi_turn:
        raise ConfigError("--workload multi-turn extends each history by the reply's token ids: gRPC servers only")
    async with server:
        results: list[Result] = []
        bar = tqdm(total=args.num_requests, desc=f"bench {args.workload}", disable=args.quiet)
        sem = asyncio.Semaphore(args.concurrency)

        async def submit(ids, max_tokens, tag="main", bounded=True):
            async with sem if bounded else contextlib.nullcontext():
                res = await _one(server, ids, max_tokens, tag, args.timeout)
            results.append(res)
            bar.update()
            return res

        async def arrivals(jobs):
            """Runs jobs (coroutine factories) at a Poisson rate, or all at once under --concurrency."""
            tasks = []
            for job in jobs:
                tasks.append(asyncio.create_task(job()))
                if args.request_rate:
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            return await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        if args.workload == "random":
            jobs = [
                functools.partial(submit, tokens(rng.randint(in_lo, in_hi)), rng.randint(out_lo, out_hi))
                for _ in range(args.num_requests)
            ]
            await arrivals(jobs)
        elif args.workload == "shared-prefix":
            questions = max(args.num_requests // args.groups, 1)
            jobs = []
            for _ in range(args.groups):
                system = tokens(args.system_len)
                for _ in range(questions):
                    ids = system + tokens(rng.randint(in_lo, in_hi))
                    jobs.append(functools.partial(submit, ids, rng.randint(out_lo, out_hi)))
            rng.shuffle(jobs)
            await arrivals(jobs)
        elif args.workload == "multi-turn":
            per_conv = max(args.turns, 1)
            convs = max(args.num_requests // per_conv, 1)

            async def conversation():
                history = tokens(rng.randint(in_lo, in_hi))
                for _ in range(per_conv):
                    res = await submit(history, rng.randint(out_lo, out_hi))
                    history = history + res.output_ids + tokens(rng.randint(8, 32))

            await arrivals([conversation for _ in range(convs)])
        else:  # long-prompt-interference
            # Its load is the steady streams and a long prompt each interval, not --concurrency:
            # bounded by it (16 by default, as many as the steady streams), each long prompt
            # waited for a steady stream to end, and the streams met none while all ran.
            steady = [
                asyncio.create_task(
                    submit(tokens(rng.randint(in_lo, in_hi)), args.steady_output_len, "steady", bounded=False)
                )
                for _ in range(args.steady_streams)
            ]
            longs = []
            await asyncio.sleep(args.interval)
            while not all(t.done() for t in steady) and len(longs) < args.num_requests - args.steady_streams:
                longs.append(asyncio.create_task(submit(tokens(args.long_prompt_len), 4, "long", bounded=False)))
                await asyncio.sleep(args.interval)
            await asyncio.gather(*steady, *longs)
        seconds = time.perf_counter() - t0
        bar.close()
    report = {"workload": args.workload, "server": args.server, "all": summarize(results, seconds)}
    if args.workload == "long-prompt-interference":
        report["steady"] = summarize(results, seconds, "steady")
        report["long"] = summarize(results, seconds, "long")
    # Each request as it went (--json; vLLM's saved results carry the same): which requests
    # make a percentile, and when they were sent.
    report["requests"] = [
        {
            "tag": r.tag,
            "sent_s": r.sent - t0,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens,
            "ttft_s": r.ttft,
            "e2e_s": r.e2e,
            "itls_s": r.itls,
            "error": r.error,
        }
        for r in sorted(results, key=lambda r: r.sent)
    ]
    return report


def print_report(report: dict) -> None:
    print(f"workload {report['workload']} against {report['server']}")
    for name in ("all", "steady", "long"):
        s = report.get(name)
        if s is None:
            continue
        print(
            f"[{name}] {s['requests']} requests ({s['errors']} errors) in {s['seconds']:.1f}s: "
            f"output {s['output_throughput']:.1f} tok/s, total {s['total_throughput']:.1f} tok/s, "
            f"prefix-cache hit rate {hit_rate_text(s['prefix_cache_hit_rate'])}"
        )
        print(f"  {'metric':8s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s}")
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            p = s[key]
            print(
                f"  {key[:-2]:8s} {p['p50'] * 1e3:9.1f} {p['p90'] * 1e3:9.1f} {p['p99'] * 1e3:9.1f} {p['mean'] * 1e3:9.1f}"
            )


def _values(kind):
    """``1,4,16`` -> [1, 4, 16] (argparse type)."""

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {kind.__name__}s separated by commas") from None
        if any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: values must be >= 0")
        return values

    return parse


def add_arguments(p) -> None:
    p.add_argument(
        "--server",
        default="127.0.0.1:50051",
        help="host:port of jaxserve's gRPC API, or http://host:port of any OpenAI-compatible server",
    )
    p.add_argument("--model", default=None, help="HTTP: the model to ask for (default: the first at /v1/models)")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-requests", type=at_least(1), default=64)
    p.add_argument(
        "--concurrency", type=_values(int), default=[16], help="requests in flight at most; a list sweeps it"
    )
    p.add_argument(
        "--request-rate",
        type=_values(float),
        default=[0.0],
        help="Poisson arrivals per second (0 = all at once); a list sweeps it",
    )
    p.add_argument("--input-len", type=span, default="100:300", help="prompt length range LO:HI")
    p.add_argument("--output-len", type=span, default="16:128", help="output length range LO:HI")
    p.add_argument("--groups", type=at_least(1), default=8, help="shared-prefix: system prompts")
    p.add_argument("--system-len", type=at_least(1), default=512, help="shared-prefix: system prompt tokens")
    p.add_argument("--turns", type=at_least(1), default=4, help="multi-turn: turns per conversation")
    p.add_argument("--steady-streams", type=at_least(1), default=4, help="interference: decode streams")
    p.add_argument("--steady-output-len", type=at_least(1), default=256, help="interference: tokens per steady stream")
    p.add_argument("--long-prompt-len", type=at_least(1), default=1024, help="interference: long prompt tokens")
    p.add_argument("--interval", type=positive_seconds, default=2.0, help="interference: seconds between long prompts")
    p.add_argument("--vocab", type=at_least(2), default=49152, help="token ids are drawn below this")
    p.add_argument("--timeout", type=positive_seconds, default=3600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the report here")
    p.add_argument("--plot", type=output_file, default=None, help="a sweep's curves as a PNG here (matplotlib)")
    p.add_argument("--quiet", action="store_true")


def sweep_axis(args) -> tuple[str, list]:
    """(the swept option, its values); a single run is a sweep of one."""
    if len(args.concurrency) > 1 and len(args.request_rate) > 1:
        raise ConfigError("sweep --concurrency or --request-rate, not both")
    if args.workload == "long-prompt-interference" and (len(args.concurrency) > 1 or len(args.request_rate) > 1):
        raise ConfigError(
            "--workload long-prompt-interference: its load is --steady-streams and --interval; "
            "sweep --concurrency or --request-rate with random, shared-prefix or multi-turn"
        )
    if len(args.request_rate) > 1:
        return "request rate (requests / s)", args.request_rate
    return "concurrency", args.concurrency


def run_sweep(args) -> dict:
    """One run per load value; each its own seed (fresh prompts)."""
    axis, values = sweep_axis(args)
    points = []
    for i, value in enumerate(values):
        one = argparse.Namespace(**vars(args))
        one.seed = args.seed + i
        one.concurrency = value if axis == "concurrency" else args.concurrency[0]
        one.request_rate = value if axis != "concurrency" else args.request_rate[0]
        if one.concurrency < 1:
            raise ConfigError(f"--concurrency {one.concurrency}: must be >= 1")
        report = asyncio.run(run_bench(one))
        report["load"] = {"concurrency": one.concurrency, "request_rate": one.request_rate}
        points.append(report)
    return {"axis": axis, "points": points}


def main(args) -> int:
    try:
        sweep = run_sweep(args)
    except ConfigError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    axis = sweep["axis"]
    for report in sweep["points"]:
        load = report["load"]
        print(f"--- concurrency {load['concurrency']}, request rate {load['request_rate'] or 'all at once'}")
        print_report(report)
    footer(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(sweep if len(sweep["points"]) > 1 else sweep["points"][0], f, indent=2)
    if args.plot:
        key = "concurrency" if axis == "concurrency" else "request_rate"
        points = [(r["load"][key], r["all"]) for r in sweep["points"]]
        (in_lo, in_hi), (out_lo, out_hi) = args.input_len, args.output_len
        title = f"jaxserve bench serve: {args.workload}, prompts {in_lo}-{in_hi} tokens, {out_lo}-{out_hi} out"
        plot.sweep(points, axis, title, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["all"]["errors"] == 0 for r in sweep["points"]) else 1
