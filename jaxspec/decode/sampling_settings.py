"""`Sampling`: the one sampling type a caller passes, to `Engine.generate` / `Engine.stream` and
to the server (`jaxspec.Sampling`, also `jaxspec.serving.Sampling`). Host values, validated in one
line; the loop reads them as device arrays (`decode.sampling.SamplingParams`, an internal), and a
config file's `sampling:` section (`config.SamplingConfig`) fills one (`Sampling.from_config`).
"""

from __future__ import annotations

import dataclasses

from jaxspec.decode.logit_bias import check_penalties
from jaxspec.decode.sampling import SamplingParams
from jaxspec.errors import JaxspecError
from jaxspec.limits import sampling_problem


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

    def device_params(self) -> SamplingParams:
        """The arrays the jitted loop reads (new values reuse the compiled program)."""
        return SamplingParams.make(*self.values)

    @classmethod
    def from_config(cls, section, **request) -> Sampling:
        """From a config's `sampling:` section (`temperature`, `top_k`, `top_p`, `min_p`, `seed`)
        plus request fields (`max_tokens`, `stop`, ...)."""
        return cls(temperature=section.temperature, top_k=section.top_k, top_p=section.top_p,
                   min_p=section.min_p, seed=section.seed, **request)
