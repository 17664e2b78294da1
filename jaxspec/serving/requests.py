"""What a request asks (`Sampling`) and what it gets back (`Completion`); validation in one line."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.decode.logit_bias import check_penalties
from jaxspec.errors import JaxspecError
from jaxspec.limits import sampling_problem
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


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-request settings. The sampling values are data in the batch (a row's law is its own);
    stop token ids and stop strings are applied host side, on the stream; `seed` fixes the row's
    randomness (None: the request's id), so a request's output does not depend on its batch."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # penalties and logit_bias (decode/logit_bias.py), applied in the loop, lossless
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # return the tokens' logprobs with this many top (None: none)

    def __post_init__(self):
        problem = sampling_problem(
            float(self.temperature), float(self.top_k), float(self.top_p), float(self.min_p)
        )
        if problem is not None:
            name, fix = problem
            raise JaxspecError(f"{name}={getattr(self, name)!r} is invalid: {fix}")
        if int(self.max_tokens) < 1:
            raise JaxspecError(f"max_tokens={self.max_tokens!r} must be at least 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise JaxspecError(
                f"stop={list(self.stop)!r}: each stop sequence must be a non-empty string"
            )
        if self.seed is not None and not 0 <= int(self.seed) < 2**31:
            raise JaxspecError(f"seed={self.seed!r} must be in 0..2**31-1")
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        if self.logprobs is not None and not 0 <= int(self.logprobs) <= 20:
            raise JaxspecError(f"logprobs={self.logprobs!r} is invalid: use 0..20")

    @property
    def penalties(self) -> tuple:
        """(presence, frequency, repetition, logit_bias dict): `penalties.make`'s row setting."""
        return (float(self.presence_penalty), float(self.frequency_penalty),
                float(self.repetition_penalty), dict(self.logit_bias))

    @property
    def values(self) -> tuple[float, int, float, float]:
        return (float(self.temperature), int(self.top_k), float(self.top_p), float(self.min_p))


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
