"""JSON Schemas drawn from every keyword jaxspec.constrain accepts (hypothesis strategies), the
schemas it must refuse (one per refused keyword or combination), and the independent check of an
output: `jsonschema` with a format checker that parses dates and times with the standard library.

Every drawn schema has bounded outputs where the vocabulary allows (strings carry a maxLength or
a finite pattern, arrays a maxItems), so a sampled run completes inside a small token budget.
"""

from __future__ import annotations

import datetime
import uuid

import jsonschema
from hypothesis import strategies as st

FORMATS_ALL = ("date", "time", "date-time", "uuid", "email")


def _bounds(kind: str):
    """integer or number bounds: both, one side, exclusive (integers only)."""
    lo = st.integers(-60, 60)
    span = st.integers(0, 150)
    both = st.tuples(lo, span).map(lambda t: {"minimum": t[0], "maximum": t[0] + t[1]})
    sides = [both, lo.map(lambda v: {"minimum": v}), lo.map(lambda v: {"maximum": v})]
    if kind == "integer":
        sides.append(st.tuples(lo, st.integers(2, 150)).map(
            lambda t: {"exclusiveMinimum": t[0], "exclusiveMaximum": t[0] + t[1]}))
    return st.one_of(sides).map(lambda b: {"type": kind} | b)


def leaves(formats=FORMATS_ALL, patterns=("[a-c]{1,3}", "^[0-9]{2}-[a-d]+$", "x|yy", "(ab)+c?")):
    """One leaf per accepted leaf keyword."""
    lengths = st.tuples(st.integers(0, 3), st.integers(0, 3)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]})
    return st.one_of(
        _bounds("integer"), _bounds("number"), lengths,
        st.sampled_from(patterns).map(lambda p: {"type": "string", "pattern": p}),
        st.sampled_from(formats).map(lambda f: {"type": "string", "format": f}),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"enum": ["x", "yz", 3, None]},
                         {"const": "ok"}, {"type": "string", "enum": ["ab", "c"]},
                         {"type": "integer", "maxDigits": 2}]),
    )


def _object(inner):
    """Properties, some required, additionalProperties absent, false or true."""
    def build(props):
        return st.builds(
            lambda req, extra: {"type": "object", "properties": props, "required": sorted(req)}
            | ({} if extra is None else {"additionalProperties": extra}),
            st.sets(st.sampled_from(sorted(props))), st.sampled_from([None, False, True]))

    props = st.dictionaries(st.sampled_from(["a", "b", "name", "age"]), inner, min_size=1, max_size=3)
    return props.flatmap(build)


def _array(inner):
    sized = st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    prefix = st.lists(inner, min_size=1, max_size=2).map(lambda xs: {"type": "array", "prefixItems": xs})
    return st.one_of(sized, prefix)


def schemas(**leaf_kw):
    """Whole schemas: leaves inside objects, arrays, anyOf and a single-branch allOf."""
    return st.recursive(
        leaves(**leaf_kw),
        lambda inner: st.one_of(
            _object(inner), _array(inner),
            st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}),
            inner.map(lambda x: {"allOf": [x]}),
        ),
        max_leaves=4,
    )


# (schema, the keyword its one-line refusal names)
REFUSED = [
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "maxProperties": 1}, "maxProperties"),
    ({"type": "integer", "multipleOf": 2}, "multipleOf"),
    ({"not": {"type": "null"}}, "not"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "minItems"),
    ({"type": "string", "pattern": "[a-z]+", "minLength": 3}, "minLength"),
    ({"type": "string", "format": "date", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": ".*"}, "pattern"),
    ({"type": "string", "pattern": "[^a]+"}, "pattern"),
    ({"type": "string", "format": "ipv4"}, "format"),
    ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "number", "exclusiveMaximum": 1}, "exclusiveMaximum"),
    ({"minimum": 1}, "minimum"),
    ({"type": ["integer", "null"], "maximum": 3}, "maximum"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "integer", "minimum": 1, "maxDigits": 1}, "maxDigits"),
    ({"allOf": [{"type": "integer"}, {"type": "integer"}]}, "allOf"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, "required"),
    ({"type": "string", "enum": ["a", 1]}, "enum"),
    ({"anyOf": [{"type": "integer"}], "maximum": 3}, "maximum"),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "multipleOf"),
]


def _checker() -> jsonschema.FormatChecker:
    """jsonschema's format checker, with date, time and date-time parsed by the standard library
    (and an offset required, as RFC 3339 does), uuid by uuid.UUID."""
    checker = jsonschema.FormatChecker()

    def fmt(name, parse):
        checker.checkers.pop(name, None)
        checker.checks(name, raises=(ValueError, TypeError))(lambda s: not isinstance(s, str) or parse(s))

    fmt("date", lambda s: datetime.date.fromisoformat(s) and len(s) == 10)
    fmt("time", lambda s: datetime.time.fromisoformat(s).tzinfo is not None)
    fmt("date-time", lambda s: "T" in s and datetime.datetime.fromisoformat(s).tzinfo is not None)
    fmt("uuid", lambda s: str(uuid.UUID(s)) == s)
    fmt("email", lambda s: s.count("@") == 1 and all(s.split("@")))
    return checker


CHECKER = _checker()


def validate(value, schema) -> None:
    """jsonschema.ValidationError unless `value` satisfies `schema`, formats included."""
    jsonschema.validate(value, schema, format_checker=CHECKER)
