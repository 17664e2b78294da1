"""The device form of a token automaton: a dense next-state table.

`next[s, t]` is the state reached from state s by token t, or -1 when t is not allowed there;
EOS is allowed (a self-loop) exactly in accepting states. Size: states x vocab x 4 bytes, e.g. a
JSON object with a few typed fields is ~10^2 states, so ~50 MB at a 128k vocabulary (docs/structured.md).
State -1 in the decode state means "unconstrained row": every token allowed, the state stays -1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class Tables(NamedTuple):
    next: jax.Array  # int32[S, V]: next state, -1 = token not allowed
    accepting: jax.Array  # bool[S]: the constraint is complete here (EOS allowed)
    initial: jax.Array  # int32[]: the start state

    @property
    def num_states(self) -> int:
        return self.next.shape[0]
