"""Request preparation, host side: a prompt (text or token ids) -> token ids, checked against
the model's (and drafter's) context and vocabulary, and a batch of them packed into the prefill
program's arrays, prompts padded to a prompt bucket (`prompt_bucket`: at most 1.25x the prompt,
few shapes) and the KV cache sized from the power-of-two `bucket` (one decode program per octave).

    prep = Requests(model, depth=spec.depth, num_nodes=spec.num_nodes)
    ids = prep.encode("Hi!")
    prep.check_fits(ids, max_new_tokens=64)       # a one-line JaxspecError if it cannot run
    batch = prep.pack([ids], 64, row_ids=[0], batch_size=1)   # numpy arrays
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.loading.tokenizer import encode_prompt
from jaxspec.models import attention

MIN_PROMPT_BUCKET = 16
PROMPT_BUCKET_STEPS = 4  # prompt buckets per power-of-two octave (padding at most 1 / STEPS)


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Round up to a power of two (at least `minimum`): few shapes, so few compilations."""
    size = minimum
    while size < n:
        size *= 2
    return size


def prompt_bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """The width a prompt of n tokens is padded to for prefill: `minimum`, else n rounded up to a
    multiple of (the power of two below n) / PROMPT_BUCKET_STEPS, at least `minimum`: 660 -> 768,
    1025 -> 1280. Padded positions stay under 1.25x the prompt past 4 x `minimum` tokens (at most
    `minimum` - 1 below), for PROMPT_BUCKET_STEPS prefill programs per octave instead of one;
    the cache (and so the decode program) is still sized by the power-of-two `bucket`."""
    if n <= minimum:
        return minimum
    step = max((1 << ((n - 1).bit_length() - 1)) // PROMPT_BUCKET_STEPS, minimum)
    return -(-n // step) * step


class Batch(NamedTuple):
    """The prefill program's per-row inputs (numpy; padding rows finish at once)."""

    prompt: np.ndarray  # int32[B, P] right-padded to the prompt bucket (`prompt_bucket`)
    lengths: np.ndarray  # int32[B]
    max_new: np.ndarray  # int32[B]
    row_ids: np.ndarray  # int32[B] request ids (a row's randomness depends on its id only)
    capacity: int  # KV-cache slots per row


@dataclasses.dataclass(frozen=True)
class Requests:
    model: Any  # a LoadedModel (tokenizer, target, eos ids) or a models.base.Model
    depth: int = 0  # tokens past the last committed one a step may write (the window's depth)
    num_nodes: int = 0  # window entries after the root
    draft_limit: int | None = None  # the draft model's context, if it has one
    max_context: int | None = None  # fixed cache slots per row (None: per request)
    chat_template: bool = True
    system_prompt: str | None = None

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            try:
                return [operator.index(t) for t in prompt]
            except TypeError:
                raise JaxspecError(
                    "a token-id prompt must be a sequence of integers: pass text as a str"
                ) from None
        tok = self.model.tokenizer
        if tok is None:
            raise JaxspecError(
                f"model {getattr(self.model, 'name', '')!r} has no tokenizer, so it cannot take text "
                f"prompts: add the tokenizer files to its directory or pass token ids"
            )
        if self.chat_template and getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return encode_prompt(tok, prompt, messages)
        return encode_prompt(tok, prompt)

    def check_fits(self, ids: list[int], max_new_tokens: int) -> None:
        """A one-line JaxspecError naming the fix when this request cannot run."""
        limit, whose = self.model.target.max_position_embeddings, "model's"
        if self.draft_limit is not None and self.draft_limit < limit:
            limit, whose = self.draft_limit, "draft model's"
        if not ids:
            raise JaxspecError("empty prompt: give at least one token")
        vocab = self.model.target.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:  # the embedding lookup would clamp it silently
            raise JaxspecError(
                f"prompt token id {bad} is out of range: this model's vocabulary has {vocab} "
                f"tokens (ids 0..{vocab - 1})"
            )
        need = len(ids) + max_new_tokens + self.depth
        if self.max_context is not None and need + 1 > self.max_context:
            raise JaxspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} (+ γ + 1 = {need + 1}"
                f" slots) exceeds generation.max_context={self.max_context}: raise max_context, "
                f"shorten the prompt or lower max_new_tokens"
            )
        if need > limit:
            raise JaxspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"{whose} context of {limit} tokens: shorten the prompt or lower max_new_tokens"
            )

    def capacity(self, prompt_bucket: int, max_new_tokens: int, backend: str | None = None) -> int:
        """KV-cache slots of a batch with prompts padded to `prompt_bucket`: max_context, else the
        prompt bucket + bucket(max_new_tokens) + the window's nodes + 1; on TPU/GPU (`backend`,
        default JAX's) rounded up to what the attention kernels take (attention.kernel_capacity)."""
        if self.max_context is not None:  # one capacity: decode compiles once per batch size
            need = max(self.max_context, prompt_bucket)
        else:
            need = prompt_bucket + bucket(max_new_tokens) + self.num_nodes + 1
        return attention.kernel_capacity(need, backend)

    def pack(self, batch_ids, max_new_tokens: int, row_ids, batch_size: int) -> Batch:
        """The batch's arrays: max(batch_size, rows) rows, prompts right-padded to the longest's
        `prompt_bucket`, the cache sized from its power-of-two `bucket`."""
        b = max(batch_size, len(batch_ids))
        longest = max(len(ids) for ids in batch_ids)
        p = prompt_bucket(longest)
        prompt = np.zeros((b, p), np.int32)
        lengths = np.ones((b,), np.int32)
        for i, ids in enumerate(batch_ids):
            prompt[i, : len(ids)] = ids
            lengths[i] = len(ids)
        max_new = np.full((b,), max_new_tokens, np.int32)
        max_new[len(batch_ids) :] = 1  # padding rows finish at once
        rows = np.zeros((b,), np.int32)
        rows[: len(row_ids)] = row_ids
        return Batch(prompt, lengths, max_new, rows, self.capacity(bucket(longest), max_new_tokens))
