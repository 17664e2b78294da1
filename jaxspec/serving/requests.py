"""What a request gets back (`Completion`) and how it fails; what it asks is `Sampling`
(jaxspec/decode/sampling_settings.py, the one sampling type), re-exported here."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.decode.sampling_settings import Sampling  # noqa: F401 (moved: jaxspec.Sampling)
from jaxspec.errors import JaxspecError
from jaxspec.serving.text import TextState


class QueueFull(JaxspecError):
    """The scheduler's queue holds `max_queue` requests already (HTTP 429)."""


class RequestFailed(JaxspecError):
    """One request failed inside the serving loop (its prefill, or what its row produced); the
    loop and the other requests go on (HTTP 500 for it alone)."""

    @classmethod
    def of(cls, error: BaseException) -> RequestFailed:
        if isinstance(error, RequestFailed):
            return error
        line = " ".join(f"{type(error).__name__}: {error}".split())
        return cls(f"this request failed in the serving loop ({line[:240]}); the server goes on")


class EngineStopped(JaxspecError):
    """The serving loop itself stopped (HTTP 503): the process exits so a supervisor restarts
    it."""


@dataclasses.dataclass
class Completion:
    """A finished request: its text and tokens, why it ended, timings and the loop's metrics."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop id or string) | "length" (max_tokens) | "cancelled"
    num_prompt_tokens: int
    time_to_first_token_s: float
    time_per_output_token_s: float
    queue_s: float  # submit -> admission (the last one, after a preemption)
    preemptions: int
    metrics: dict[str, Any]
    # per token {"logprob", "top": [(id, logprob), ...]} when the request asked for logprobs
    logprobs: list[dict] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage block (cached_tokens: prompt tokens whose KV came from the prefix
        cache) plus the speculative loop's figures for this request."""
        m = self.metrics
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_generated_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": m.get("prefix_cached_tokens", 0)},
            "speculative": {
                "method": m.get("method", "plain"),
                "num_steps": m.get("num_steps", 0),
                "num_draft_tokens": m.get("num_draft_tokens", 0),
                "num_accepted_tokens": m.get("num_accepted_tokens", 0),
                "acceptance_rate": m.get("acceptance_rate", 0.0),
                "mean_accepted_length": m.get("mean_accepted_length", 1.0),
                "preemptions": self.preemptions,
                "time_to_first_token_s": self.time_to_first_token_s,
                "time_per_output_token_s": self.time_per_output_token_s,
            },
        }


@dataclasses.dataclass(eq=False)
class Request:
    """One request's life in the scheduler: its prompt, settings, sink and timings, the slot it
    holds (-1: queued) and what was streamed (replayed after a preemption, not sent again)."""

    id: str
    prompt_ids: list[int]
    sampling: Sampling
    seed: int
    sink: Any  # .push(piece) / .finish(Completion): api.Stream
    submitted: float
    admitted: float = 0.0
    first_token: float = 0.0
    slot: int = -1
    generated: list[int] = dataclasses.field(default_factory=list)  # tokens streamed so far
    text: TextState | None = None
    cancelled: bool = False
    preemptions: int = 0
    peak_pages: int = 0  # the most KV pages the request held at once
    cached_tokens: int = 0  # prompt tokens whose k/v came from the prefix cache (last admission)
    replay: int = 0  # tokens of `generated` a restarted row recomputes before it streams again
    logprobs: list | None = None  # `generated`'s logprobs (asked for: Sampling.logprobs)
    priority: int = 0  # higher first under serving.policy=priority
    constraint: str | None = None  # the structured-output regex (serving.grammars), None: free
    cache_salt: bytes = b""  # the tenant's prefix-cache namespace (serving.prefix)
