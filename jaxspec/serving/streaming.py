"""What a row's committed tokens mean to its request after a device call: the new text streamed
(stop ids and strings applied host side), whether and why the request ended, and its
`Completion` (text, tokens, timings, the loop's metrics for the row).

Host side, no state of its own beyond its settings: `read` advances one request from the host
copy of a device call and says why it ended (None: it goes on); the ledger ends it."""

from __future__ import annotations

import time
from typing import Any

from jaxspec.decode import logprob_record
from jaxspec.serving.requests import Completion, Request, RequestFailed


class Streaming:
    def __init__(self, engine, spec, page_size: int, prefix_cache: str, kv_layout):
        self.engine, self.spec = engine, spec
        self.page_size, self.prefix_cache = page_size, prefix_cache
        self.kv_layout = kv_layout  # () -> the device state's cache layout

    def read(self, req: Request, host, now: float) -> str | None:
        """`req`'s new tokens from `host` (a device call's fields): its new text pushed to its
        sink; -> why it ended ("stop", "length") or None. Raises RequestFailed for a row whose
        tokens cannot be text (the caller fails that request alone)."""
        slot, p = req.slot, len(req.prompt_ids)
        out = host.tokens[slot, p : host.lengths[slot]].tolist()
        vocab = self.engine.target.vocab_size
        bad = next((t for t in out if not 0 <= t < vocab), None)
        if bad is not None:  # never a token: NaN probabilities sample out of the vocabulary
            raise RequestFailed(f"this request's sampling produced token id {bad}, outside the "
                                f"vocabulary [0, {vocab}): its sampling values give no "
                                "distribution; the server goes on")
        if len(out) < req.replay:  # a restarted row still recomputing what was streamed
            return None
        req.replay = 0
        stop_ids = set(req.sampling.stop_token_ids)
        reason = None
        cut = next((i for i, t in enumerate(out) if t in stop_ids), None)
        if cut is not None:
            out, reason = out[: cut + 1], "stop"
        elif bool(host.done[slot]):
            hit_eos = bool(out) and out[-1] in self.spec.eos_ids
            reason = "stop" if hit_eos else "length"
        if len(out) > len(req.generated) and not req.first_token:
            req.first_token = now
        req.generated = out
        if req.sampling.logprobs is not None and getattr(host, "logprobs", None) is not None:
            req.logprobs = logprob_record.row_entries(host.logprobs, slot, p, p + len(out))
        text = self.engine.decode_text([t for t in out if t not in stop_ids])
        piece, stopped = req.text.advance(text, final=reason is not None)
        if piece:
            req.sink.push(piece)
        return "stop" if stopped else reason

    def completion(self, req: Request, reason: str, host=None) -> Completion:
        n = len(req.generated)
        metrics: dict[str, Any] = {"method": self.engine.method}
        if host is not None:
            metrics = self.engine.row_metrics(host, req.slot, n)
        metrics |= {"kv_pages": req.peak_pages, "kv_page_size": self.page_size,
                    "kv_layout": self.kv_layout(), "prefix_cache": self.prefix_cache,
                    "prefix_cached_tokens": req.cached_tokens}
        now = time.perf_counter()
        first = req.first_token or now
        text = self.engine.decode_text([t for t in req.generated
                                        if t not in set(req.sampling.stop_token_ids)])
        if req.sampling.stop:
            cut = min((i for i in (text.find(s) for s in req.sampling.stop) if i >= 0),
                      default=len(text))
            text = text[:cut]
        return Completion(
            request_id=req.id,
            text=text,
            token_ids=list(req.generated),
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_ids),
            time_to_first_token_s=first - req.submitted,
            time_per_output_token_s=(now - first) / (n - 1) if n > 1 else 0.0,
            queue_s=(req.admitted or now) - req.submitted,
            preemptions=req.preemptions,
            metrics=metrics,
            logprobs=req.logprobs,
        )
