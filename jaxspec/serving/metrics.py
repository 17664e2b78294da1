"""Prometheus metrics for the HTTP server (`GET /metrics`, text format, `prometheus_client`).

Counted per request as it ends (the HTTP layer calls `ServerMetrics.observe`): requests by
finish reason, prompt and returned tokens, time to first token and per output token
(histograms), drafted and accepted tokens and the mean accepted length per speculative method.
Read from the server at each scrape (`Server.health()`): queue depth, running rows, KV pages
used / free / cached, device calls and preemptions. Each app has its own registry, so several
servers in one process (tests) do not share counters.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPTED_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


class _Live:
    """Gauges and counters the server already keeps, read at scrape time."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        h = self.server.health()
        gauges = {
            "jaxspec_queue_depth": ("Requests waiting for a row", h["queued"]),
            "jaxspec_running_rows": ("Rows decoding (requests in flight)", h["active"]),
            "jaxspec_slots": ("Rows the decode program runs over", h["slots"]),
            "jaxspec_kv_pages_used": ("KV pages held by rows or the prefix cache",
                                      h["kv_pages"] - h["free_pages"]),
            "jaxspec_kv_pages_free": ("KV pages free", h["free_pages"]),
            "jaxspec_kv_pages_cached": ("KV pages kept for prefix sharing", h["cached_pages"]),
            "jaxspec_kv_pages": ("KV pages in the pool", h["kv_pages"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("jaxspec_preemptions", "Rows preempted for pages (recomputed)",
                                  value=h["preemptions"])
        yield CounterMetricFamily("jaxspec_device_calls", "Decode device calls",
                                  value=h["device_calls"])


class ServerMetrics:
    """One app's metrics registry; `observe` a request as it ends, `render` for a scrape."""

    def __init__(self, server):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxspec_requests", "Requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("jaxspec_prompt_tokens", "Prompt tokens of ended requests",
                                     registry=r)
        self.generation_tokens = Counter("jaxspec_generation_tokens",
                                         "Completion tokens returned", registry=r)
        self.ttft = Histogram("jaxspec_time_to_first_token_seconds",
                              "Submit to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxspec_time_per_output_token_seconds",
                              "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.drafted = Counter("jaxspec_spec_draft_tokens", "Tokens drafted", ["method"],
                               registry=r)
        self.accepted = Counter("jaxspec_spec_accepted_tokens", "Drafted tokens accepted",
                                ["method"], registry=r)
        self.accepted_length = Histogram(
            "jaxspec_spec_accepted_length", "A request's mean tokens committed per step",
            ["method"], buckets=ACCEPTED_LENGTH_BUCKETS, registry=r)
        r.register(_Live(server))

    def observe(self, finish_reason: str, usage: dict[str, Any]) -> None:
        """One ended request: its finish reason as returned, its (returned) usage block."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        spec = usage.get("speculative", {})
        if usage["completion_tokens"]:
            self.ttft.observe(spec.get("time_to_first_token_s", 0.0))
        if usage["completion_tokens"] > 1:
            self.tpot.observe(spec.get("time_per_output_token_s", 0.0))
        method = spec.get("method", "plain")
        self.drafted.labels(method).inc(spec.get("num_draft_tokens", 0))
        self.accepted.labels(method).inc(spec.get("num_accepted_tokens", 0))
        if spec.get("num_steps", 0):
            self.accepted_length.labels(method).observe(spec.get("mean_accepted_length", 1.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
