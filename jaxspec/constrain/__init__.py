"""Structured output: constraints (JSON Schema, regex, choice) compiled to on-device token tables.

compile.py turns a constraint into a regex and the regex into a token automaton (outlines-core);
tables.py is the device pytree; mask.py the pure functions the decode loop calls.
"""

from jaxspec.constrain.compile import (
    Constraint,
    compile_tables,
    constraint_regex,
    vocabulary_from_tokens,
)
from jaxspec.constrain.mask import (
    advance,
    allowed,
    chain_states,
    mask_probs,
    tree_states,
    valid_prefix,
)
from jaxspec.constrain.tables import Tables

__all__ = [
    "Constraint", "Tables", "advance", "allowed", "chain_states", "compile_tables", "constraint_regex",
    "mask_probs", "tree_states", "valid_prefix", "vocabulary_from_tokens",
]
