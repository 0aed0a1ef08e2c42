"""Prometheus metrics, updated from the engine thread after each step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("jaxserve_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("jaxserve_requests_running", "Requests in the running batch", registry=r)
        self.pages_used = Gauge("jaxserve_kv_pages_used", "KV pages in use (requests and prefix cache)", registry=r)
        self.pages_total = Gauge("jaxserve_kv_pages_total", "KV pages in the pool", registry=r)
        self.hit_rate = Gauge("jaxserve_prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens", registry=r)
        self.compiles = Gauge("jaxserve_compiles", "XLA compiles since start", registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens computed", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("jaxserve_requests_finished", "Finished requests", ["reason"], registry=r)
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

    def stop(self) -> None:
        """Closes the /metrics endpoint (no-op if it was never served)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def on_step(self, thread, advanced, finished, now: float) -> None:
        stats = thread.engine.stats()
        self.queue_depth.set(thread.num_waiting)
        self.running.set(stats["num_running"])
        self.pages_total.set(stats["pages_total"])
        self.pages_used.set(stats["pages_total"] - stats["pages_free"])
        self.hit_rate.set(stats["prefix_cache_hit_tokens"] / max(stats["prefix_cache_queried_tokens"], 1))
        self.compiles.set(stats["num_compiles"])
        self.prompt_tokens.inc(stats["prefill_tokens_computed"] - self._last_prefill)
        self.generation_tokens.inc(len(advanced))  # each advanced request got one token
        self._last_prefill = stats["prefill_tokens_computed"]
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
