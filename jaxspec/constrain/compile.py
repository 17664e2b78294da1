"""Constraint -> regex -> token automaton (outlines-core) -> dense `Tables`.

outlines-core was picked because its `Index(regex, vocabulary)` is exactly a token-level DFA
(per state: allowed tokens and the next state), which maps one-to-one onto a device table, so
the whole decode loop stays one compiled program; xgrammar/llguidance are pushdown automata with
a host-side mask per step. JSON Schema goes through `outlines_core.json_schema` after
constrain/schema.py checks it: each keyword is enforced (by outlines-core or by a regex of ours)
or refused with a one-line error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import numpy as np

from jaxspec.constrain.schema import prepare, substitute
from jaxspec.constrain.tables import Tables

@dataclasses.dataclass(frozen=True)
class Constraint:
    """Exactly one of: a JSON Schema (dict or JSON text), json_object (any JSON object), a regex,
    or a list of choices (the output is one of them verbatim)."""

    json_schema: object = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self):
        given = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None]
        if sum(given) != 1:
            raise ValueError("a constraint takes exactly one of json_schema, json_object, regex, choice")


def constraint_regex(c: Constraint) -> str:
    """The regex a constraint compiles to (ValueError naming the problem otherwise)."""
    from outlines_core.json_schema import build_regex_from_schema

    if c.regex is not None:
        re.compile(c.regex)  # a bad regex fails here with Python's own message
        return c.regex
    if c.choice is not None:
        if not c.choice:
            raise ValueError("guided_choice needs at least one choice")
        return "(" + "|".join(re.escape(s) for s in c.choice) + ")"
    schema = {"type": "object"} if c.json_object else c.json_schema
    if isinstance(schema, str):
        schema = json.loads(schema)
    prepared, subs = prepare(schema)
    try:
        regex = build_regex_from_schema(json.dumps(prepared, sort_keys=True))
    except (ValueError, TypeError) as e:
        raise ValueError(f"unsupported JSON Schema: {str(e).splitlines()[0]}") from None
    return substitute(regex, subs)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def vocabulary_from_tokens(tokenizer) -> dict[int, bytes]:
    """An HF tokenizer -> {token id: the bytes it decodes to}, special tokens left out.

    Byte-level BPE ("Ġ" = space) and SentencePiece ("▁" = space, "<0x0A>" = a byte) are both
    mapped back to raw bytes, which is what outlines-core's automaton matches."""
    byte_of = _bytes_to_unicode()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = {}
    for text, tid in tokenizer.get_vocab().items():
        if tid in special:
            continue
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
        if m:
            out[tid] = bytes([int(m.group(1), 16)])
        elif all(ch in byte_of for ch in text):
            out[tid] = bytes(byte_of[ch] for ch in text)
        else:
            out[tid] = text.replace("▁", " ").encode()
    return out


def compile_tables(regex: str, tokens: dict[int, bytes], eos_id: int, vocab_size: int) -> Tables:
    """regex + {token id: bytes} -> dense Tables over `vocab_size` ids (the model's, which may
    exceed the tokenizer's; ids with no bytes are never allowed). States are renumbered 0..S-1."""
    key = (regex, eos_id, vocab_size, tuple(sorted(tokens.items())))
    nxt, accepting, initial = _compile_cached(key)
    import jax.numpy as jnp

    return Tables(jnp.asarray(nxt), jnp.asarray(accepting), jnp.asarray(initial, jnp.int32))


@functools.lru_cache(maxsize=64)
def _compile_cached(key):
    from outlines_core import Index, Vocabulary

    regex, eos_id, vocab_size, items = key
    by_bytes: dict[bytes, list[int]] = {}
    for tid, b in items:
        if tid != eos_id and b:
            by_bytes.setdefault(b, []).append(tid)
    index = Index(regex, Vocabulary(eos_id, by_bytes))
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    states = sorted(set(transitions) | finals | {index.get_initial_state()})
    dense = {s: i for i, s in enumerate(states)}
    nxt = np.full((len(states), vocab_size), -1, np.int32)
    for s, row in transitions.items():
        for tid, s2 in row.items():
            if tid < vocab_size:
                nxt[dense[s], tid] = dense[s2]
    accepting = np.array([s in finals for s in states], bool)
    nxt[accepting, eos_id] = np.flatnonzero(accepting)  # EOS: allowed, and only, where complete
    nxt[~accepting, eos_id] = -1
    return nxt, accepting, dense[index.get_initial_state()]
