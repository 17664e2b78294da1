"""The decoding core: one draft -> verify -> accept -> commit step and its jitted loop
(speculate), the acceptance rules, draft trees, sampling, the KV cache, and adaptive
speculation with its calibration."""
