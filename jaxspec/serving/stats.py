"""The scheduler's counters (`Scheduler.stats`): device calls by shape, prefill/decode time,
admissions, preemptions, prefix-cache hits, the page high-water mark; read by bench.serve and
the server's /metrics."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Stats:
    device_calls: int = 0
    # device calls by (rows, page-table slots) of the program that ran, read from its state
    calls_by_shape: dict = dataclasses.field(default_factory=collections.Counter)
    decode_s: float = 0.0
    prefill_s: float = 0.0
    prefill_calls: int = 0  # device calls that prefilled (whole prompts, tails, chunks)
    prefill_chunks: int = 0  # prompt chunks written before their prompt's last piece
    max_prefill_call_tokens: int = 0  # the most prompt tokens one prefill call ran (no padding)
    admitted: int = 0
    finished: int = 0
    preemptions: int = 0
    failed: int = 0  # requests ended by a failure of their own (the loop went on)
    prompt_tokens: int = 0  # prompt tokens admitted (readmissions included)
    prefix_cached_tokens: int = 0  # of those, tokens whose k/v came from the prefix cache
    max_round_prefill_tokens: int = 0  # the most prompt tokens prefilled in one round (batched)
    peak_used_pages: int = 0  # the most distinct KV pages rows held at once (shared: once)
