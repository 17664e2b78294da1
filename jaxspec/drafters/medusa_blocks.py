"""Medusa heads as published (FasterDecoding, vLLM): per head, J residual blocks
`x <- x + SiLU(W x + b)` on the target's final-normed hidden state, then that head's own
vocabulary projection. Head k (1..K) reads h_t and predicts x_{t+k+1}; the γ drafts are the first
γ heads' samples (a chain). jaxspec's own Medusa (drafters/medusa.py) is the special case J = 1
with every head sharing the target's LM-head rows.

Params: {"w": [K, J, D, D] ([out, in]), "b": [K, J, D], "heads": [Kh, N, D] (Kh = K, or 1 when
all heads share one projection), "d2t": int32[N] target ids of the N head rows (N = V: identity)}.
Draft probs are `logits_to_probs` over the N logits scattered into the full vocabulary (lossless).
State: the target hidden state h_t [B, D].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, Traits
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.drafters.feature_chain import linear
from jaxspec.errors import JaxspecError


def head_logits(dparams, h, num_heads: int):
    """h [..., D] -> f32[K', ..., N] for the first `num_heads` heads."""
    shared = dparams["heads"].shape[0] == 1

    def one(k):
        x = h.astype(jnp.float32)
        for j in range(dparams["w"].shape[1]):
            x = x + jax.nn.silu(linear(x, dparams["w"][k, j]) + dparams["b"][k, j])
        return linear(x, dparams["heads"][0 if shared else k])

    return jnp.stack([one(k) for k in range(num_heads)]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MedusaBlocksDrafter:
    num_heads: int  # K
    target_vocab: int
    final_layer: int  # the target's num_layers: HF index of the final-normed hidden state
    name: str = "medusa"
    variable_length: bool = False

    @property
    def traits(self) -> Traits:  # the protocol's optional behaviour (decode/drafter.py)
        return Traits()

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.final_layer,)

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        h = prompt_hidden[0]  # [B, P, D]
        return jnp.take_along_axis(h, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sp, keys):
        if num_tokens > self.num_heads:
            raise JaxspecError(
                f"num_speculative_tokens={num_tokens} exceeds the {self.num_heads} Medusa heads "
                f"of this checkpoint: use num_speculative_tokens <= {self.num_heads}"
            )
        b = state.shape[0]
        probs_n = sampling.logits_to_probs(head_logits(dparams, state, num_tokens), sp)  # [G, B, N]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        idx = jax.vmap(sampling.sample_rows, in_axes=(1, 0), out_axes=1)(step_keys, probs_n)
        probs = scatter_to_target(jnp.swapaxes(probs_n, 0, 1), dparams["d2t"], self.target_vocab)
        num = jnp.full((b,), num_tokens, jnp.int32)
        return Proposal(dparams["d2t"][idx], probs, num), state

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        h = ctx.hidden[0]  # [B, G+1, D]; window position n produced the newest committed token
        return jnp.take_along_axis(h, ctx.num_accepted[:, None, None], axis=1)[:, 0]
