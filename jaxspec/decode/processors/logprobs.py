"""The emitted tokens' logprobs as a processor (carry: `decode.logprob_record.Record` in
`DecodeState.logprobs`, made at prefill when `LoopSpec.logprobs` is set): verify reads the
scored logits of every entry, commit writes the accepted path's (decode/logprobs.py)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.decode import logprob_record, logprobs
from jaxspec.decode.processors.base import Processor


def score_logits(spec, logits, adjusted):
    """The logits the emitted tokens' logprobs are read from: the model's own ("raw") or the
    request's penalties, logit_bias and constraint applied ("processed", which
    `logprobs.log_probs` then puts through the sampling transform)."""
    return logits if spec.logprobs_mode == "raw" else adjusted


class LogprobsProcessor(Processor):
    field = "logprobs"

    def read(self, spec, sp, carry, logits, adjusted):
        return score_logits(spec, logits, adjusted).astype(jnp.float32)

    def commit(self, spec, sp, carry, aux, read, step):
        scored = logprobs.path_scored(read, step.path, step.path_tokens, step.num_accepted,
                                      step.next_token, spec.logprobs, sp, spec.logprobs_mode)
        return logprob_record.write(carry, step.prev_lengths, step.lengths - step.prev_lengths,
                                    scored)


LOGPROBS = LogprobsProcessor()
