"""What the HTTP server lets in and how it stops: the API key, request limits, readiness and the
graceful drain. Pure host-side bookkeeping over `api.Stream`s; no device work.

- `Limits`: the `serving` config's request ceilings (body bytes and seconds to send them, prompt
  tokens, `max_tokens`, seconds per request) and the drain budget.
- `Gate`: the key check (`hmac.compare_digest`), `ready` (programs compiled), `draining`
  (SIGTERM seen: new requests get 503), the streams in flight, and `drain`: wait for them up to
  `drain_s`, then end the rest (they finish with `finish_reason: "abort"`).
"""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time


@dataclasses.dataclass(frozen=True)
class Limits:
    """Request ceilings (0: none beyond what serving.max_context allows)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 0
    max_tokens: int = 0
    request_timeout_s: float = 600.0
    drain_s: float = 30.0
    body_timeout_s: float = 30.0  # a request body not whole by then gets 408 (serving.body)

    @classmethod
    def of(cls, serving) -> Limits:
        """From a ServingConfig."""
        return cls(max_body_bytes=serving.max_body_bytes,
                   max_prompt_tokens=serving.max_prompt_tokens,
                   max_tokens=serving.max_tokens_limit,
                   request_timeout_s=serving.request_timeout_s, drain_s=serving.drain_s)


class Gate:
    """Admission state shared by the app's handlers (event loop) and the stopping thread."""

    def __init__(self, api_key: str | None = None, limits: Limits | None = None,
                 ready: bool = True):
        self.api_key = api_key or None
        self.limits = limits or Limits()
        self.ready = ready
        self.draining = False
        self._lock = threading.Lock()
        self._inflight: set = set()  # api.Stream
        self._aborted: set = set()  # ended by the drain
        self._timed_out: set = set()  # ended by request_timeout_s

    def authorized(self, header: str | None) -> bool:
        """Whether an Authorization header carries the key (always, without a key)."""
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode())

    # ---- streams in flight -----------------------------------------------------------------
    def enter(self, stream) -> None:
        with self._lock:
            self._inflight.add(stream)

    def leave(self, stream) -> None:
        with self._lock:
            self._inflight.discard(stream)
            self._aborted.discard(stream)
            self._timed_out.discard(stream)

    def time_out(self, stream) -> None:
        """request_timeout_s passed: end the request (it finishes with "length")."""
        with self._lock:
            if stream not in self._inflight:
                return
            self._timed_out.add(stream)
        stream.cancel()

    def finish_reason(self, stream, reason: str) -> str:
        """The reason a client sees: "abort" for the drain, "length" for the time limit."""
        with self._lock:
            if stream in self._aborted:
                return "abort"
            if stream in self._timed_out:
                return "length"
        return reason

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def drain(self, poll_s: float = 0.05, settle_s: float = 30.0) -> int:
        """Stop admission, wait up to `limits.drain_s` for the requests in flight, then end the
        rest; returns once none is left (or after `settle_s` more). -> requests aborted."""
        self.draining = True
        end = time.monotonic() + self.limits.drain_s
        while self.inflight and time.monotonic() < end:
            time.sleep(poll_s)
        with self._lock:
            rest = list(self._inflight)
            self._aborted.update(rest)
        for stream in rest:
            stream.cancel()
        end = time.monotonic() + settle_s
        while self.inflight and time.monotonic() < end:
            time.sleep(poll_s)
        return len(rest)
