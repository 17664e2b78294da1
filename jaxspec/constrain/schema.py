"""JSON Schema -> the schema outlines-core compiles, every keyword jaxspec accepts enforced.

outlines-core 0.2 drops some keywords silently: integer and number bounds, `minLength` beside a
`pattern` or `format`, `minItems` beside `prefixItems`, `minProperties`, `required` names that no
property declares, `allOf` of two (concatenated), a `pattern` with a top-level `|` (unbracketed).
So a schema is checked and rewritten first: each keyword is either enforced (by outlines-core, or
here: a subschema outlines-core would get wrong becomes a placeholder `const` whose quoted marker
the caller swaps for a regex of ours in the compiled regex) or refused with a one-line ValueError
naming it. What is enforced is a subset of the schema's language (no exponent in a bounded
number, Feb 1-28 in a date): every output validates, not every valid value is reachable.
"""

from __future__ import annotations

import re

ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples"})
ACCEPTED = ANNOTATIONS | frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "uniqueItems", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions",
    "pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minDigits", "maxDigits",
})
_REFUSED_WHY = {
    "oneOf": "an output may match two branches: use 'anyOf'",
    "minProperties": "not enforced by the automaton: use 'required'",
    "maxProperties": "not enforced by the automaton: use 'properties' with additionalProperties false",
}
_MAPS = ("properties", "$defs", "definitions")
_LISTS = ("anyOf", "allOf", "prefixItems")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

DATE = (r"[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
        r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,20}[a-z0-9])?"
# outlines-core's email regex allows a quoted local part, a quote inside a JSON string: ours not
OWN_FORMATS = {"date": DATE, "time": TIME, "date-time": f"{DATE}T{TIME}",
               "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
               "email": rf"[a-z0-9_%+-]+(?:\.[a-z0-9_%+-]+)*@{_LABEL}(?:\.{_LABEL})+"}
FORMATS = frozenset(OWN_FORMATS)
# pattern pieces that can match a quote, a backslash or a control character (which JSON must
# escape, so the pattern's match would not be a JSON string as it stands)
_UNSAFE_PATTERN = re.compile(r'(?<!\\)\.|\[\^|\\[SWDsnrtfv]|"|\\\\|\\x|\\u|\\p|\\P|\\A|\\z|\\b|\\B|\(\?')


def refuse(keyword: str, where: str, why: str) -> ValueError:
    return ValueError(f"JSON Schema keyword {keyword!r} at {where}: {why}")


def _digits_between(lo: str, hi: str) -> str:
    """Strings of len(lo) == len(hi) digits between lo and hi (leading zeros allowed)."""
    if lo == hi:
        return lo
    if set(lo) == {"0"} and set(hi) == {"9"}:
        return f"[0-9]{{{len(lo)}}}"
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + f"(?:{_digits_between(lo[1:], hi[1:])})"
    n = len(lo) - 1
    parts = [lo[0] + f"(?:{_digits_between(lo[1:], '9' * n)})"]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{n}}}")
    parts.append(hi[0] + f"(?:{_digits_between('0' * n, hi[1:])})")
    return "|".join(parts)


def uint_range(lo: int, hi: int | None) -> str:
    """A regex of the decimal integers in [lo, hi] (hi None: unbounded), lo >= 0, no leading 0."""
    top = len(str(lo)) if hi is None else len(str(hi))
    parts = []
    for n in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
        if a <= b:
            parts.append(_digits_between(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{top},}}")
    return "|".join(f"(?:{p})" for p in parts)


def integer_regex(lo: int | None, hi: int | None) -> str:
    """A regex of the JSON integers in [lo, hi] (None: unbounded on that side)."""
    parts = []
    if lo is None or lo < 0:  # negatives: magnitudes in [max(1, -hi), -lo]
        mlo = -hi if hi is not None and hi < 0 else 1
        if lo is None or mlo <= -lo:
            parts.append(f"-(?:{uint_range(mlo, None if lo is None else -lo)})")
    if hi is None or hi >= 0:
        a = 0 if lo is None else max(lo, 0)
        if hi is None or a <= hi:
            parts.append(uint_range(a, hi))
    return "|".join(f"(?:{p})" for p in parts)


def number_regex(lo: int | None, hi: int | None) -> str:
    """A regex of JSON numbers in [lo, hi] (integral bounds), written without an exponent and
    with at most 15 fraction digits (a double holds no more), so a sampled number ends."""

    def magnitude(mlo: int, mhi: int | None) -> str:  # i(.f)? with mlo <= i.f <= mhi
        if mhi is None:
            return f"(?:{uint_range(mlo, None)})(?:\\.[0-9]{{1,15}})?"
        head = [f"(?:{uint_range(mlo, mhi - 1)})(?:\\.[0-9]{{1,15}})?"] if mlo <= mhi - 1 else []
        return "|".join(head + [f"{mhi}(?:\\.0{{1,15}})?"])

    parts = []
    if hi is None or hi >= 0:
        parts.append(magnitude(0 if lo is None else max(lo, 0), hi))
    if lo is None or lo < 0:
        parts.append(f"-(?:{magnitude(-hi if hi is not None and hi < 0 else 0, None if lo is None else -lo)})")
    return "|".join(f"(?:{p})" for p in parts)


def _bounds(node: dict, where: str, kind: str) -> tuple[int | None, int | None]:
    """A numeric node's inclusive integral bounds, or a refusal naming the keyword."""
    lo = hi = None
    for key in _BOUNDS:
        value = node.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(key, where, "must be a number")
        if kind == "number" and (key.startswith("exclusive") or not float(value).is_integer()):
            raise refuse(key, where, "a number's bound must be an inclusive whole number here")
        if key in ("minimum", "exclusiveMinimum"):
            v = (int(value) + 1 if key == "exclusiveMinimum" and float(value).is_integer() else -(-value // 1))
            lo = int(v) if lo is None else max(lo, int(v))
        else:
            v = (int(value) - 1 if key == "exclusiveMaximum" and float(value).is_integer() else value // 1)
            hi = int(v) if hi is None else min(hi, int(v))
    if lo is not None and hi is not None and lo > hi:
        raise refuse("minimum", where, f"no {kind} lies between the bounds")
    return lo, hi


def _json_type(value) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    return {str: {"string"}, list: {"array"}, dict: {"object"}}.get(type(value), {"?"})


def _check_combinations(node: dict, where: str) -> None:
    """Refuse the keyword combinations outlines-core drops one side of."""
    constraining = set(node) - ANNOTATIONS - {"type", "$defs", "definitions"}
    where_to = {"anyOf": "the branches", "allOf": "the branch", "$ref": "the referenced schema",
                "enum": "the listed values", "const": "the listed value"}
    for combinator, target in where_to.items():
        others = sorted(constraining - {combinator})
        if combinator in node and others:
            raise refuse(others[0], where, f"not enforced beside {combinator!r}: move it into {target}")
    types = node.get("type")
    if ("enum" in node or "const" in node) and isinstance(types, str):
        values = node["enum"] if "enum" in node else [node["const"]]
        wrong = [v for v in values if types not in _json_type(v)]
        if wrong:
            raise refuse("enum" if "enum" in node else "const", where, f"{wrong[0]!r} is not of type {types!r}")
    if "allOf" in node and len(node["allOf"]) != 1:
        raise refuse("allOf", where, "only one subschema is enforced: merge them")
    if node.get("uniqueItems") is True:
        raise refuse("uniqueItems", where, "not enforced by the automaton: remove it")
    if "prefixItems" in node and {"items", "minItems", "maxItems"} & set(node):
        raise refuse(sorted({"items", "minItems", "maxItems"} & set(node))[0], where,
                     "not enforced beside 'prefixItems': list every position in prefixItems")
    if "required" in node:
        missing = sorted(set(node["required"]) - set(node.get("properties", {})))
        if missing:
            raise refuse("required", where, f"{missing[0]!r} is not in 'properties': declare it")
    text = {"pattern", "format", "minLength", "maxLength"} & set(node)
    if "pattern" in node and text - {"pattern"} or "format" in node and text - {"format"}:
        key = "pattern" if "pattern" in node else "format"
        raise refuse(sorted(text - {key})[0], where, f"not enforced beside {key!r}: fold it into a pattern")
    if set(_BOUNDS) & set(node) and {"minDigits", "maxDigits"} & set(node):
        raise refuse(sorted({"minDigits", "maxDigits"} & set(node))[0], where, "not enforced beside bounds")


def _own_regex(node: dict, where: str) -> str | None:
    """The regex of ours a node compiles to (with its JSON quotes), or None for outlines-core's."""
    kind = node.get("type")
    if set(_BOUNDS) & set(node):
        if kind not in ("integer", "number"):
            raise refuse(sorted(set(_BOUNDS) & set(node))[0], where, "needs 'type' 'integer' or 'number'")
        lo, hi = _bounds(node, where, kind)
        return integer_regex(lo, hi) if kind == "integer" else number_regex(lo, hi)
    if "format" in node:
        if node["format"] not in FORMATS:
            raise refuse("format", where, f"{node['format']!r} is not enforced (enforced: "
                         f"{', '.join(sorted(FORMATS))}): use a pattern")
        return f'"(?:{OWN_FORMATS[node["format"]]})"'
    if "pattern" in node:
        pattern = node["pattern"]
        if not isinstance(pattern, str):
            raise refuse("pattern", where, "must be a string")
        pattern = pattern[1:] if pattern.startswith("^") else pattern
        pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
        if _UNSAFE_PATTERN.search(pattern):
            raise refuse("pattern", where, "may match a quote, backslash or control character, which "
                         "JSON escapes: spell the characters out in a class like [a-z0-9 ]")
        try:
            re.compile(pattern)
        except re.error as e:
            raise refuse("pattern", where, f"not a regex ({e})") from None
        return f'"(?:{pattern})"'
    return None


def prepare(schema, where: str = "schema", subs: dict | None = None):
    """-> (the schema for outlines-core, {marker: regex}). Every keyword is checked (a ValueError
    naming it otherwise); subschemas outlines-core would not enforce become marker consts."""
    subs = {} if subs is None else subs
    if isinstance(schema, bool):
        return schema, subs
    if not isinstance(schema, dict):
        raise TypeError(f"{where} must be a JSON object, got {type(schema).__name__}")
    for key in schema:
        if key in _REFUSED_WHY:
            raise refuse(key, where, _REFUSED_WHY[key])
        if key not in ACCEPTED:
            raise ValueError(f"unsupported JSON Schema keyword {key!r} at {where}; remove it or "
                             "constrain with a regex instead")
    _check_combinations(schema, where)
    own = _own_regex(schema, where)
    if own is not None:
        marker = f"JAXSPECRX{len(subs)}"
        subs[marker] = own
        return {"const": marker}, subs
    out = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            value = {name: prepare(sub, f"{where}.{key}.{name}", subs)[0] for name, sub in value.items()}
        elif key in _LISTS and isinstance(value, list):
            value = [prepare(sub, f"{where}.{key}[{i}]", subs)[0] for i, sub in enumerate(value)]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = prepare(value, f"{where}.{key}", subs)[0]
        out[key] = value
    return out, subs


def substitute(regex: str, subs: dict[str, str]) -> str:
    """outlines-core's regex with each quoted marker swapped for its regex (a marker may be
    gone: a subschema no output reaches, as the items of maxItems 0)."""
    for marker, own in subs.items():
        regex = regex.replace(f'"{marker}"', f"(?:{own})")
    return regex
