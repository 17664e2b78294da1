"""Structured output in continuous batching (`serving.structured`): one fixed-size grammar table
on device shared by every slot, so the decode program never changes shape as constraints come
and go.

Each distinct constraint is a block of the table (its states at an offset); a request's row
starts at its block's initial state, a free row is -1. A new constraint is appended; when the
table is full, blocks no live row uses are dropped and the table is rebuilt compacted, the live
rows' states moved by their block's shift (`Grammar.state += delta`). Host tables are compiled
at submit time (a bad schema is a 400 there), cached by regex (constrain.host).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.constrain.host import GrammarCompiler, check
from jaxspec.constrain.loop import UNCONSTRAINED, Grammar, padded_tables, stack_blocks
from jaxspec.errors import JaxspecError


class GrammarSlots:
    def __init__(self, engine, slots: int, max_states: int = 4096, max_classes: int = 1024):
        m = engine.model
        self.compiler = GrammarCompiler(m.tokenizer, m.target.vocab_size, tuple(m.eos_token_ids))
        self.slots, self.max_states, self.max_classes = slots, max_states, max_classes
        self.vocab = m.target.vocab_size
        self.order: list[str] = []  # block regexes in table order
        self.offsets: dict[str, int] = {}
        self.slot_regex: list[str | None] = [None] * slots
        self.tables = self._upload(None)

    def compile(self, constraint) -> str:
        """Host tables for a request's constraint (at submit: errors are the client's) -> its
        regex, the key admission passes back."""
        regex = check(constraint)
        nxt = self.compiler.tables(constraint)[0]
        if nxt.shape[0] > self.max_states:
            raise JaxspecError(f"the constraint compiles to {nxt.shape[0]} automaton states: "
                               f"serving.structured_states={self.max_states} holds fewer; raise it")
        return regex

    def _upload(self, built):
        if built is None:  # nothing yet: every token allowed nowhere, no row constrained
            return (jnp.full((self.max_states, 16), -1, jnp.int32),
                    jnp.zeros((self.vocab,), jnp.int32), jnp.zeros((self.max_states,), bool))
        by_class, class_of, acc = built
        return jnp.asarray(by_class), jnp.asarray(class_of), jnp.asarray(acc)

    def _build(self, order):
        blocks = [self.compiler._tables[r] for r in order]
        dense, acc, offsets = stack_blocks(blocks, self.compiler.eos_ids)
        if dense.shape[0] > self.max_states:
            return None, None
        return padded_tables(dense, acc, self.max_states, self.max_classes), offsets

    def admit(self, regexes: list[str | None], slots: list[int], live: set[int]) -> np.ndarray | None:
        """Make room for these rows' constraints (`live`: slots whose rows stay). -> int32[slots]
        the state shift of every live row when the table was rebuilt compacted, else None."""
        new = [r for r in dict.fromkeys(regexes) if r is not None and r not in self.offsets]
        delta = None
        if new:
            order = self.order + new
            built, offsets = self._build(order)
            if built is None:  # full: keep only the blocks live rows and these rows use
                keep = {self.slot_regex[s] for s in live} | set(regexes)
                order = [r for r in self.order if r in keep] + new
                built, offsets = self._build(order)
                if built is None:
                    raise JaxspecError(
                        "the structured-output table is full (serving.structured_states / "
                        "structured_classes): raise them, or send fewer distinct schemas at once")
                old = dict(self.offsets)
                new_offsets = dict(zip(order, offsets))
                delta = np.zeros((self.slots,), np.int32)
                for s in live:
                    r = self.slot_regex[s]
                    if r is not None:
                        delta[s] = new_offsets[r] - old[r]
            # wider column classes than fit (the pad) also land here
            self.order, self.offsets = order, dict(zip(order, offsets))
            self.tables = self._upload(built)
        for r, s in zip(regexes, slots):
            self.slot_regex[s] = r
        return delta

    def rows(self, regexes: list[str | None]) -> Grammar:
        """The Grammar a prefill of these rows takes: the current table, each row's start."""
        starts = [UNCONSTRAINED if r is None else
                  self.offsets[r] + int(self.compiler._tables[r][2]) for r in regexes]
        n = len(regexes)
        # copies: the decode loop donates its state, tables included
        return Grammar(*(jnp.copy(t) for t in self.tables), jnp.asarray(starts, jnp.int32),
                       jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32))

    def into_state(self, state, delta):
        """`state` with the current table (and live rows shifted by `delta`)."""
        g = state.grammar
        moved = g.state if delta is None else jnp.where(g.state >= 0, g.state + jnp.asarray(delta), g.state)
        return dataclasses.replace(state, grammar=Grammar(*(jnp.copy(t) for t in self.tables),
                                                          moved, g.num_masked, g.num_proposed))
