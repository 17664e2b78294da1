"""The decoding core: one draft -> verify -> accept -> commit step and its jitted loop
(speculate), the step's extras as logits processors (processors/: penalties and logit_bias, the
grammar mask, the logprob record), the acceptance rules, draft trees, sampling, the KV cache,
and adaptive speculation with its calibration."""
