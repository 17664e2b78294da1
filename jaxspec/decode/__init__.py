"""The decoding core, for research code: one draft -> window -> verify -> accept -> commit step and
its jitted loop, prefill, the acceptance rules, draft trees, sampling, and the drafter protocol.

    from jaxspec import decode
    spec = decode.LoopSpec(target=model.target, drafter=None, num_speculative_tokens=0,
                           eos_ids=tuple(model.eos_token_ids))
    state = decode.prefill(spec, ...)          # the prompt through the target, the cache filled
    state = decode.decode(spec, tparams, dparams, state, sp, max_steps)   # the jitted loop
    n, token = decode.accept_row(tokens, q, p, key)   # the rejection rule, one row

Every name is imported on first use (PEP 562). Modules: `speculate` (the loop), `prefill`,
`state` (`LoopSpec`, `DecodeState`), `acceptance`, `tree` (windows, static and dynamic trees),
`sampling` (logits -> probs), `sampling_settings` (`Sampling`, the user-facing type),
`drafter` (the protocol), `adaptive*` (adaptive speculation).
"""

from jaxspec.exports import lazy

EXPORTS = {
    # the loop and its state
    "decode": "jaxspec.decode.speculate",
    "decode_step": "jaxspec.decode.speculate",
    "verify": "jaxspec.decode.speculate",
    "prefill": "jaxspec.decode.prefill",
    "LoopSpec": "jaxspec.decode.state",
    "DecodeState": "jaxspec.decode.state",
    # acceptance (rejection sampling, chains and trees)
    "accept": "jaxspec.decode.acceptance",
    "accept_row": "jaxspec.decode.acceptance",
    "accept_tree": "jaxspec.decode.acceptance",
    # draft trees and the verify window
    "Window": "jaxspec.decode.tree",
    "build_window": "jaxspec.decode.tree",
    "chain_parents": "jaxspec.decode.tree",
    # sampling
    "Sampling": "jaxspec.decode.sampling_settings",
    "SamplingParams": "jaxspec.decode.sampling",
    "logits_to_probs": "jaxspec.decode.sampling",
    "sample": "jaxspec.decode.sampling",
    # the drafter protocol
    "Drafter": "jaxspec.decode.drafter",
    "Proposal": "jaxspec.decode.drafter",
    "DraftContext": "jaxspec.decode.drafter",
    "CommitContext": "jaxspec.decode.drafter",
    "traits": "jaxspec.decode.drafter",
}

__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
