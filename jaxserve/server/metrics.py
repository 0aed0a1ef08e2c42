"""Prometheus metrics.

Live figures (requests waiting and running, KV pages by who holds them, compiles,
aborted requests) are read at scrape time from the engine thread's latest snapshot, which
it replaces after every step and every batch of adds and aborts: an idle server reads
exactly what it holds, not what the last step saw. Latencies and token counts are updated
from the engine thread after each step; rejections from the servicer as they happen.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ABORT_REASONS = ("cancelled", "error", "shutdown")
# Why a request was refused before it reached the engine (the gRPC status follows).
REJECT_REASONS = (
    "invalid_argument",  # INVALID_ARGUMENT: a field out of range, a prompt too long
    "queue_full",  # RESOURCE_EXHAUSTED: max_waiting_requests
    "client_requests",  # RESOURCE_EXHAUSTED: max_requests_per_client
    "client_tokens",  # RESOURCE_EXHAUSTED: max_queued_tokens_per_client
    "request_id_in_use",  # ALREADY_EXISTS
    "shutting_down",  # UNAVAILABLE
)


class _Live:
    """A collector over the engine thread's snapshot (one consistent moment per scrape)."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        for name, key, doc in (
            ("jaxserve_requests_waiting", "requests_waiting", "Requests waiting to be scheduled"),
            ("jaxserve_requests_running", "requests_running", "Requests in the running batch"),
            ("jaxserve_kv_pages_total", "kv_pages_total", "KV pages in the pool"),
            (
                "jaxserve_compiles",
                "num_compiles",
                "Step programs made since start, compiled or loaded from the compile cache: the warm-up's, "
                "then one per program a step had to wait for",
            ),
            (
                "jaxserve_compiles_loaded",
                "num_compiles_loaded",
                "Of jaxserve_compiles, those loaded from the compile cache",
            ),
            ("jaxserve_kv_pages_pinned", "kv_pages_pinned", "KV pages on leased (pinned) prefixes, of the cached"),
            ("jaxserve_leases", "leases", "Leases pinning a prefix in the cache"),
        ):
            yield GaugeMetricFamily(name, doc, value=s.get(key, 0))
        pages = GaugeMetricFamily(
            "jaxserve_kv_pages",
            "KV pages by state: held (by requests in flight), cached (prefix cache only; evictable), free",
            labels=["state"],
        )
        for state in ("held", "cached", "free"):
            pages.add_metric([state], s.get(f"kv_pages_{state}", 0))
        yield pages
        hit, queried = s.get("prefix_cache_hit_tokens", 0), s.get("prefix_cache_queried_tokens", 0)
        yield GaugeMetricFamily(
            "jaxserve_prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens", value=hit / max(queried, 1)
        )
        aborted = CounterMetricFamily(
            "jaxserve_requests_aborted",
            "Requests ended before finishing: cancelled (by the caller: cancel, deadline, disconnect, Abort), "
            "error (a failed step), shutdown (drain ran out)",
            labels=["reason"],
        )
        for reason in ABORT_REASONS:
            aborted.add_metric([reason], s.get(f"aborted_{reason}", 0))
        yield aborted


class Metrics:
    def __init__(self, snapshot=dict):
        """``snapshot``: returns the engine thread's live figures (a dict)."""
        self.registry = r = CollectorRegistry()
        r.register(_Live(snapshot))
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens computed", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("jaxserve_requests_finished", "Finished requests", ["reason"], registry=r)
        self.rejected = Counter(
            "jaxserve_requests_rejected", "Requests refused before reaching the engine", ["reason"], registry=r
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)  # every reason is listed, at 0, from the start
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "jaxserve_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram("jaxserve_e2e_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self._last_token_at: dict[str, float] = {}
        self._last_prefill = 0
        self._httpd = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves /metrics over HTTP; returns the bound port (0 picks a free one)."""
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_address[1]

    def exposition(self) -> tuple[bytes, str]:
        """What /metrics answers (the text and its content type), for a server's own port."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def stop(self) -> None:
        """Closes the /metrics endpoint (no-op if it was never served)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def on_step(self, thread, advanced, finished, now: float) -> None:
        prefill = thread.engine.counters["prefill_tokens_computed"]  # (the engine thread's own: exact each step)
        self.prompt_tokens.inc(prefill - self._last_prefill)
        self._last_prefill = prefill
        self.generation_tokens.inc(len(advanced))  # each advanced request got one token
        for r in advanced:
            last = self._last_token_at.get(r.request_id)
            if last is None:
                stream = thread._streams.get(r.request_id)
                if stream is not None:
                    self.ttft.observe(now - stream.submitted_at)
            else:
                self.itl.observe(now - last)
            self._last_token_at[r.request_id] = now
        for r in finished:
            self._last_token_at.pop(r.request_id, None)
            self.finished.labels(r.finish_reason or "abort").inc()
            stream = thread._streams.get(r.request_id)
            if stream is not None:
                self.e2e.observe(now - stream.submitted_at)
        if len(self._last_token_at) > 2 * len(thread._streams) + 64:  # aborted requests' entries
            self._last_token_at = {k: v for k, v in self._last_token_at.items() if k in thread._streams}
