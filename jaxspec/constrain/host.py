"""Host side of constrained generation: a request's constraint fields -> `Constraint`, and a
batch's constraints -> the device `Grammar` (constrain/loop.py), compiled once per regex and
stacked once per combination (both cached: a repeated schema costs nothing).

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    grammar = compiler.batch([Constraint(regex="(yes|no)"), None], rows=2)
"""

from __future__ import annotations

import json
from collections import OrderedDict

import jax.numpy as jnp
import numpy as np

from jaxspec.constrain.compile import Constraint, _compile_cached, constraint_regex, vocabulary_from_tokens
from jaxspec.constrain.loop import Grammar, batch_grammar
from jaxspec.errors import JaxspecError


def make_constraint(*, json_schema=None, json_object: bool = False, regex: str | None = None,
                    choice=None) -> Constraint | None:
    """The API's constraint fields (at most one set) -> Constraint, or None when none is set;
    a one-line JaxspecError for a bad combination or an unsupported schema keyword."""
    given = {k: v for k, v in dict(json_schema=json_schema, json_object=json_object or None,
                                  regex=regex, choice=choice).items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise JaxspecError(f"constraints {sorted(given)} given together: pass exactly one")
    if choice is not None:
        if isinstance(choice, str) or not all(isinstance(c, str) for c in choice) or not choice:
            raise JaxspecError("guided_choice must be a non-empty list of strings")
        choice = tuple(choice)
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise JaxspecError(f"json_schema is not valid JSON ({e.msg}): pass a JSON Schema object") from None
    c = Constraint(json_schema=json_schema, json_object=bool(json_object), regex=regex, choice=choice)
    check(c)
    return c


def check(c: Constraint) -> str:
    """The constraint's regex; a one-line JaxspecError naming the problem otherwise."""
    try:
        return constraint_regex(c)
    except Exception as e:  # noqa: BLE001 (re.error, ValueError, TypeError: one line for all)
        raise JaxspecError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


class GrammarCompiler:
    """One tokenizer's constraints compiled to host tables, and batches of them to `Grammar`."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...], max_batches: int = 8):
        if tokenizer is None:
            raise JaxspecError("constrained generation needs the model's tokenizer: load a model with one")
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._tokens = tuple(sorted(vocabulary_from_tokens(tokenizer).items()))
        self._tables: dict[str, tuple] = {}
        self._batches: OrderedDict = OrderedDict()
        self._max_batches = max_batches

    def tables(self, c: Constraint) -> tuple[np.ndarray, np.ndarray, int]:
        """(next int32[S, V], accepting bool[S], initial) on the host, cached by regex."""
        regex = check(c)
        if regex not in self._tables:
            key = (regex, self.eos_ids[0], self.vocab_size, self._tokens)
            try:
                self._tables[regex] = _compile_cached(key)
            except Exception as e:  # noqa: BLE001 (outlines-core's errors: one line)
                raise JaxspecError(f"constraint cannot be compiled: {str(e).splitlines()[0]}") from None
        return self._tables[regex]

    def batch(self, constraints: list[Constraint | None], rows: int) -> Grammar | None:
        """The batch's Grammar (rows past the list free), or None when no row is constrained."""
        if all(c is None for c in constraints):
            return None
        regexes = tuple(None if c is None else check(c) for c in constraints)
        key = (regexes, rows)
        if key in self._batches:
            self._batches.move_to_end(key)
        else:
            tables = [None if c is None else self.tables(c) for c in constraints]
            self._batches[key] = batch_grammar(tables, rows, self.eos_ids)
            while len(self._batches) > self._max_batches:
                self._batches.popitem(last=False)
        # a fresh device copy per run: the decode loop donates its state, grammar included
        return Grammar(*(jnp.asarray(x) for x in self._batches[key]))


def shape_key(grammar: Grammar | None):
    """What a grammar adds to a program's cache key: its padded table shapes."""
    if grammar is None:
        return None
    return grammar.next_by_class.shape
