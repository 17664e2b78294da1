"""Structured output in continuous batching (`serving.structured`): one fixed-size grammar table
on device shared by every slot, so the decode program never changes shape as constraints come
and go.

Each distinct constraint is a block of the table (its states at an offset); a request's row
starts at its block's initial state, a free row is -1. A new constraint is appended; when the
table is full, blocks no live row uses are dropped and the table is rebuilt compacted, the live
rows' states moved by their block's shift (`Grammar.state += delta`). Host tables are compiled
at submit time (a bad schema is a 400 there), cached by regex (constrain.host).

Bounded (a constraint is a client's input): a regex whose automaton needs more states than the
table holds is refused before it compiles (a finite language's longest string of L characters
needs L + 1 states: `[a-z]{3000}` took 70 s and 563 MB to learn that); a compile runs on one
worker thread under a time budget (`compile_s`; past it the request gets a 400 and the worker
finishes alone); the host tables are kept in an LRU bounded by bytes (`cache_bytes`), blocks on
device never evicted (an evicted one is compiled again when a queued request is admitted).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import re._parser as sre
import threading

import jax.numpy as jnp
import numpy as np

from jaxspec.constrain import compile as constrain_compile
from jaxspec.constrain.host import GrammarCompiler, check
from jaxspec.constrain.loop import UNCONSTRAINED, Grammar, padded_tables, stack_blocks
from jaxspec.errors import JaxspecError


COMPILE_S = 20.0  # a constraint's compile budget (seconds)
CACHE_BYTES = 512 << 20  # host tables kept (int32[S, V] each: a 3000-state schema on a 49k
# vocabulary is 590 MB)
KEPT_CONSTRAINTS = 4096  # constraints remembered to recompile an evicted block


def states_needed(regex: str) -> int:
    """A lower bound on the automaton states a regex needs: its longest match + 1 when that is
    finite, else its shortest + 1 (0: Python's parser does not read it; the compile decides)."""
    try:
        low, high = sre.parse(regex).getwidth()
    except Exception:  # noqa: BLE001 -- another dialect's syntax: no estimate
        return 0
    return (high if high < sre.MAXREPEAT else low) + 1


class GrammarSlots:
    def __init__(self, engine, slots: int, max_states: int = 4096, max_classes: int = 1024,
                 compile_s: float = COMPILE_S, cache_bytes: int = CACHE_BYTES):
        m = engine.model
        self._model = m
        self._compiler: GrammarCompiler | None = None  # the vocabulary scan: at the first compile
        self._compiler_lock = threading.Lock()
        self.slots, self.max_states, self.max_classes = slots, max_states, max_classes
        self.compile_s, self.cache_bytes = compile_s, cache_bytes
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "jaxspec-grammar")
        self._lock = threading.Lock()  # one compile's bookkeeping at a time
        self._sizes: collections.OrderedDict = collections.OrderedDict()  # regex -> bytes, LRU
        self._constraints: collections.OrderedDict = collections.OrderedDict()  # regex -> it
        self.vocab = m.target.vocab_size
        self.order: list[str] = []  # block regexes in table order
        self.offsets: dict[str, int] = {}
        self.slot_regex: list[str | None] = [None] * slots
        self.tables = self._upload(None)

    @property
    def compiler(self) -> GrammarCompiler:
        """The tokenizer's compiler, built at the first constraint (its vocabulary scan, ~2 s on
        a 49k vocabulary, is paid by the first structured request, not by every server start)."""
        with self._compiler_lock:
            if self._compiler is None:
                m = self._model
                self._compiler = GrammarCompiler(m.tokenizer, m.target.vocab_size,
                                                 tuple(m.eos_token_ids))
            return self._compiler

    def compile(self, constraint) -> str:
        """Host tables for a request's constraint (at submit: errors are the client's) -> its
        regex, the key admission passes back. Bounded as the module says; thread-safe, and
        called off the serving thread (the HTTP layer compiles on a worker before it submits)."""
        regex = check(constraint)
        with self._lock:
            self._constraints[regex] = constraint
            self._constraints.move_to_end(regex)
            while len(self._constraints) > KEPT_CONSTRAINTS:
                self._constraints.popitem(last=False)
            if regex in self._sizes:
                self._sizes.move_to_end(regex)
                return regex
        self._check_size(regex)
        job = self._worker.submit(self.compiler.tables, constraint)  # (the scan, if first, here)
        try:
            nxt, accepting, _ = job.result(timeout=self.compile_s)
        except concurrent.futures.TimeoutError:
            raise JaxspecError(f"the constraint did not compile within {self.compile_s:g} s: "
                               "simplify it") from None
        if nxt.shape[0] > self.max_states:
            self.compiler._tables.pop(regex, None)
            raise JaxspecError(f"the constraint compiles to {nxt.shape[0]} automaton states: "
                               f"serving.structured_states={self.max_states} holds fewer; raise it")
        self._kept(regex, nxt.nbytes + accepting.nbytes)
        return regex

    def _check_size(self, regex: str) -> None:
        """A one-line JaxspecError when the regex's automaton cannot fit, before compiling."""
        need = states_needed(regex)
        if need > self.max_states:
            raise JaxspecError(f"the constraint needs at least {need} automaton states: the "
                               f"table holds {self.max_states}; simplify it (shorter counted "
                               "repeats, fewer fixed lengths)")
        if need * self.vocab * 4 > self.cache_bytes:  # its host table alone: int32[S, V]
            raise JaxspecError(f"the constraint needs at least {need} automaton states, "
                               f"{need * self.vocab * 4:,} bytes of tables over this "
                               f"vocabulary (the cache holds {self.cache_bytes:,}); simplify it")

    def _kept(self, regex: str, size: int) -> None:
        """A compiled regex counted in the LRU, the least recent dropped past `cache_bytes`
        (not blocks on device); the compile function's own cache emptied (this one bounds)."""
        with self._lock:
            constrain_compile._compile_cached.cache_clear()
            self._sizes[regex] = size
            total = sum(self._sizes.values())
            for old in list(self._sizes):
                if total <= self.cache_bytes:
                    break
                if old in self.offsets or old == regex:
                    continue
                total -= self._sizes.pop(old)
                self.compiler._tables.pop(old, None)

    @property
    def cached_bytes(self) -> int:
        """Bytes of host tables kept (at most `cache_bytes` beyond the blocks on device)."""
        with self._lock:
            return sum(self._sizes.values())

    def _host(self, regex: str):
        """A block's host tables, compiled again if the LRU dropped them since its submit."""
        tables = self.compiler._tables.get(regex)
        if tables is None:
            tables = self.compiler.tables(self._constraints[regex])
            self._kept(regex, tables[0].nbytes + tables[1].nbytes)
        return tables

    def _upload(self, built):
        if built is None:  # nothing yet: no row constrained; the shapes every table has, so
            # the first constraint changes no program (int32[4096, 1024]: 16 MB by default)
            built = (np.full((self.max_states, self.max_classes), -1, np.int32),
                     np.zeros((self.vocab,), np.int32), np.zeros((self.max_states,), bool))
        by_class, class_of, acc = built  # host arrays, put on device as every later table is
        return jnp.asarray(by_class), jnp.asarray(class_of), jnp.asarray(acc)

    def _build(self, order):
        blocks = [self._host(r) for r in order]
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
                  self.offsets[r] + int(self._host(r)[2]) for r in regexes]
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
