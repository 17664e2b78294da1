"""Penalties and logit_bias as a processor (carry: `decode.penalties.Penalties` in
`DecodeState.penalties`): each window entry's logits adjusted with the counts of its own path,
the accepted tokens counted after the step. The transform and its losslessness argument are in
decode/penalties.py and decode/logit_bias.py."""

from __future__ import annotations

from jaxspec.decode import penalties as penalties_lib
from jaxspec.decode.processors.base import Processor


class PenaltiesProcessor(Processor):
    field = "penalties"

    def start(self, carry, prompt, lengths):
        return penalties_lib.with_prompt(carry, prompt, lengths)

    def adjust(self, carry, aux, logits, tokens, mask):
        return penalties_lib.window_logits(carry, logits, tokens, mask)

    def commit(self, spec, sp, carry, aux, read, step):
        return penalties_lib.commit(carry, step.tokens, step.prev_lengths, step.lengths,
                                    step.path.shape[1])


PENALTIES = PenaltiesProcessor()
