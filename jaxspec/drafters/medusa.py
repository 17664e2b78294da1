"""Medusa heads: K residual blocks on the target's last (final-normed) hidden state, chain drafts.

Head k (1..K) reads h_t, the target's hidden state at the position whose output was the newest
committed token x_{t+1}, and predicts x_{t+k+1}:  logits_k = head · (h_t + silu(W_k h_t + b_k)),
through the target's frozen LM-head rows for the draft vocabulary (`head` [N, D], `d2t` int32[N]).
The γ drafts are the first γ heads' samples (a chain). Draft probs are `logits_to_probs` over
the N draft logits scattered into the full vocabulary, so the acceptance rule stays lossless.

Static tree (`tree_choices`, Medusa's choices list, see `jaxspec.decode.tree.check_choices`): node
[r_1, ..., r_d] is the rank-r_d candidate of head d (ranked by its logits), under node
[r_1, ..., r_{d-1}]. Candidates are deterministic given the context, so each node's q is the
one-hot of its token (the acceptance rule's one-hot case: lossless).

Params: {"w": [K, D, D] ([out, in] per head), "b": [K, D], "head": [N, D], "d2t": int32[N]}.
State: the target hidden state h_t [B, D] (from the prompt at init, from the verify window at
the accepted position in commit).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.decode import sampling, tree
from jaxspec.drafters import trained
from jaxspec.drafters.base import CommitContext, DraftContext, Proposal, Traits
from jaxspec.drafters.draft_vocab import scatter_to_target
from jaxspec.drafters.registry import BuildContext, register_drafter
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder


def head_logits(dparams, h):
    """h [..., D] -> f32[K, ..., N]: every head's draft-vocabulary logits."""

    def one(w, b):
        return decoder.linear(h + jax.nn.silu(decoder.linear(h, w) + b), dparams["head"])

    return jax.vmap(one)(dparams["w"], dparams["b"]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
    num_heads: int  # K
    target_vocab: int
    final_layer: int  # the target's num_layers: HF index of the final-normed hidden state
    name: str = "medusa"
    variable_length: bool = False
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # None: a chain of γ heads

    @property
    def traits(self) -> Traits:  # the protocol's optional behaviour (decode/drafter.py)
        return Traits(tree_nodes=self.tree_nodes, tree_depth=self.tree_depth)

    def __post_init__(self):
        if self.tree_choices is not None:
            choices = tree.check_choices(self.tree_choices)
            if max(map(len, choices)) > self.num_heads:
                raise JaxspecError(
                    f"tree choices reach depth {max(map(len, choices))} but this checkpoint has "
                    f"{self.num_heads} Medusa heads: use paths of at most {self.num_heads} ranks"
                )
            object.__setattr__(self, "tree_choices", choices)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.final_layer,)

    @property
    def tree_nodes(self) -> int | None:
        return None if self.tree_choices is None else len(self.tree_choices)

    @property
    def tree_depth(self) -> int | None:
        return None if self.tree_choices is None else max(map(len, self.tree_choices))

    def _propose_tree(self, dparams, state):
        parents, depth, rank = tree.static_layout(self.tree_choices)
        d, k = max(depth), max(rank) + 1
        sub = {**dparams, "w": dparams["w"][:d], "b": dparams["b"][:d]}
        top = jax.lax.top_k(head_logits(sub, state), k)[1]  # [D, B, K] draft indices by rank
        idx = top[jnp.asarray(depth) - 1, :, jnp.asarray(rank)]  # [N, B]
        tokens = dparams["d2t"][idx.T]  # [B, N]
        b, n = tokens.shape
        probs = jax.nn.one_hot(tokens, self.target_vocab, dtype=jnp.float32)  # [B, N, V]
        par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
        return Proposal(tokens, probs, jnp.full((b,), n, jnp.int32), par), state

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        h = prompt_hidden[0]  # [B, P, D]
        return jnp.take_along_axis(h, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

    def propose(self, dparams, tparams, state, ctx: DraftContext, num_tokens, sp, keys):
        if self.tree_choices is not None:
            return self._propose_tree(dparams, state)
        if num_tokens > self.num_heads:
            raise JaxspecError(
                f"num_speculative_tokens={num_tokens} exceeds the {self.num_heads} Medusa heads "
                f"of this checkpoint: use num_speculative_tokens <= {self.num_heads}"
            )
        b = state.shape[0]
        sub = {**dparams, "w": dparams["w"][:num_tokens], "b": dparams["b"][:num_tokens]}
        probs_n = sampling.logits_to_probs(head_logits(sub, state), sp)  # [G, B, N]
        step_keys = jax.vmap(lambda k: jax.random.split(k, num_tokens))(keys)  # [B, G]
        idx = jax.vmap(sampling.sample_rows, in_axes=(1, 0), out_axes=1)(step_keys, probs_n)
        probs = scatter_to_target(jnp.swapaxes(probs_n, 0, 1), dparams["d2t"], self.target_vocab)
        num = jnp.full((b,), num_tokens, jnp.int32)
        return Proposal(dparams["d2t"][idx], probs, num), state

    def commit(self, dparams, tparams, state, ctx: CommitContext):
        h = ctx.hidden[0]  # [B, D+1, D] on the path; path entry n produced the newest token
        return jnp.take_along_axis(h, ctx.num_accepted[:, None, None], axis=1)[:, 0]


# ---- method "medusa" --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaOptions(trained.CheckpointOptions):
    """speculative.medusa: jaxspec's Medusa heads, or vLLM / FasterDecoding layouts. A static tree
    (speculative.tree.kind=static) takes its paths from speculative.tree.choices."""

    SECTION: ClassVar[str] = "speculative.medusa"

    def check(self, spec):
        if spec.tree.kind == "static" and spec.tree.choices is None:
            raise JaxspecError(
                "speculative.tree.kind=static with medusa needs speculative.tree.choices, "
                "e.g. [[0], [1], [0, 0]]"
            )


def build(options: MedusaOptions, ctx: BuildContext):
    drafter, dparams = trained.load("medusa", options, ctx)
    tree = ctx.spec.tree
    if tree.kind == "static":
        if not isinstance(drafter, MedusaDrafter):
            raise JaxspecError(
                f"speculative.tree.kind=static works with jaxspec's own Medusa heads, not the "
                f"{drafter.name} heads in {options.checkpoint}: use speculative.tree.kind=chain"
            )
        drafter = dataclasses.replace(drafter, tree_choices=tuple(tuple(p) for p in tree.choices))
    return drafter, dparams


register_drafter(
    "medusa", build, train="jaxspec.train.methods:Medusa", formats=("jaxspec", "medusa", "medusa_fd"),
    options=MedusaOptions, tree_kinds=("static",),
    summary="residual heads on the last hidden state")
