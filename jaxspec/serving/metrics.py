"""Prometheus metrics for the HTTP server (`GET /metrics`, text format, `prometheus_client`).

Counted per request as it ends (the HTTP layer calls `ServerMetrics.observe`): requests by
finish reason, prompt and returned tokens, time to first token and per output token
(histograms), drafted and accepted tokens and the mean accepted length per speculative method.
Read from the server at each scrape (`Server.health()`): queue depth, running rows, KV pages
used / free / cached, device calls and preemptions. Each app has its own registry, so several
servers in one process (tests) do not share counters.

A drafter with a confidence head (DSpark chains) adds its calibration per draft position: the
predicted survival summed (and the survival the scheduler used, after its online correction),
the acceptances observed and the steps that verified the position
(predicted / steps against observed / steps is the calibration), and the steps by verify length
the scheduler chose (`calibration_lines`).
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
        self.calibration = calibration_lines(r)
        r.register(_Live(server))

    def observe(self, finish_reason: str, usage: dict[str, Any],
                metrics: dict[str, Any] | None = None) -> None:
        """One ended request: its finish reason as returned, its (returned) usage block, and
        the loop's metrics of the request (`Completion.metrics`: the calibration, if any)."""
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
        observe_calibration(self.calibration, method, metrics or {})

    def render(self) -> bytes:
        return generate_latest(self.registry)


def calibration_lines(registry) -> dict[str, Counter]:
    """The confidence head's counters (labels: method, draft position or verify length)."""
    pos = ["method", "position"]
    return {
        "predicted": Counter("jaxspec_spec_confidence_predicted", "Predicted survival of each "
                             "verified draft position, summed", pos, registry=registry),
        "used": Counter("jaxspec_spec_confidence_used", "Survival the scheduler priced each "
                        "verified draft position with (after the online correction), summed",
                        pos, registry=registry),
        "observed": Counter("jaxspec_spec_confidence_observed", "Drafts accepted at each "
                            "verified draft position", pos, registry=registry),
        "steps": Counter("jaxspec_spec_confidence_steps", "Steps that verified each draft "
                         "position", pos, registry=registry),
        "lengths": Counter("jaxspec_spec_verify_length_steps", "Steps by the number of drafts "
                           "the confidence scheduler chose to verify", ["method", "length"],
                           registry=registry),
    }


def observe_calibration(lines: dict[str, Counter], method: str, m: dict[str, Any]) -> None:
    """One request's calibration record (dspark_heads.calibration_metrics: per-position means
    over its verified steps, the verify-length histogram) added to the counters."""
    steps = m.get("confidence_steps_per_position")
    if not steps:
        return
    predicted = m.get("confidence_predicted_per_position") or []
    observed = m.get("confidence_observed_per_position") or []
    for i, n in enumerate(steps):
        if not n:
            continue
        label = (method, str(i))
        lines["steps"].labels(*label).inc(n)
        lines["predicted"].labels(*label).inc((predicted[i] or 0.0) * n)
        used = m.get("confidence_used_per_position") or []
        if i < len(used):
            lines["used"].labels(*label).inc((used[i] or 0.0) * n)
        lines["observed"].labels(*label).inc(round((observed[i] or 0.0) * n))
    for k, count in enumerate(m.get("verify_length_hist") or []):
        if count:
            lines["lengths"].labels(method, str(k)).inc(count)
