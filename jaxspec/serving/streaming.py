"""What a row's committed tokens mean to its request after a device call: the new text streamed
(stop ids and strings applied host side), whether and why the request ended, and its
`Completion` (text, tokens, timings, the loop's metrics for the row).

A mixin of `scheduler.Scheduler`: `_stream_row` calls the scheduler's `_finish`."""

from __future__ import annotations

import time
from typing import Any

from jaxspec.decode import logprob_record
from jaxspec.serving.requests import Completion, Request, RequestFailed


class Streaming:
    def _stream_rows(self, host, now: float) -> None:
        """Every live row streamed; a row whose tokens or text cannot be read fails alone (its
        request gets the error, its row and pages are freed), the others go on."""
        for slot, req in list(self.active.items()):
            try:
                self._stream_row(req, host, now)
            except Exception as e:  # noqa: BLE001 -- confined to the request that caused it
                self._fail(req, e)

    def _fail(self, req: Request, error: BaseException) -> None:
        """End `req` with RequestFailed: its row (if it holds one) and pages are freed."""
        if req.slot >= 0 and self.active.get(req.slot) is req:
            self._release(req)
        self.stats.failed += 1
        req.sink.finish(None, RequestFailed.of(error))

    def _stream_row(self, req: Request, host, now: float) -> None:
        slot, p = req.slot, len(req.prompt_ids)
        out = host.tokens[slot, p : host.lengths[slot]].tolist()
        vocab = self.engine.target.vocab_size
        bad = next((t for t in out if not 0 <= t < vocab), None)
        if bad is not None:  # never a token: NaN probabilities sample out of the vocabulary
            raise RequestFailed(f"this request's sampling produced token id {bad}, outside the "
                                f"vocabulary [0, {vocab}): its sampling values give no "
                                "distribution; the server goes on")
        if len(out) < req.replay:  # a restarted row still recomputing what was streamed
            return
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
        if stopped:
            reason = "stop"
        if reason is not None:
            self._finish(req, reason, host)

    def _completion(self, req: Request, reason: str, host=None) -> Completion:
        n = len(req.generated)
        metrics: dict[str, Any] = {"method": self.engine.method}
        if host is not None:
            metrics = self.engine.row_metrics(host, req.slot, n)
        metrics |= {"kv_pages": req.peak_pages, "kv_page_size": self.pool.page_size,
                    "kv_layout": self.kv_layout, "prefix_cache": self.prefix_cache,
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
