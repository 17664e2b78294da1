"""Checked option sections: frozen keyword-only dataclasses whose fields are type-checked and
range-checked on construction. No jax: `jaxspec.config` and each drafter's options use them.

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NgramOptions(Section):
        SECTION: ClassVar[str] = "speculative.ngram"   # the dotted key every error names
        max_ngram: int = 3

        def _validate(self):
            if self.max_ngram < 1:
                self._fail("max_ngram", "use an integer >= 1")

A field typed as another Section is a nested subsection (`speculative.tree`); the loader
(`jaxspec.config.load_config`) reads it from a YAML mapping or from `a.b.key=value` overrides.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, Literal

from jaxspec.errors import JaxspecError, short


class Section:
    """Shared checks. Subclasses set SECTION (the dotted YAML key) and may add `_validate`."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = coerce(f"{self.SECTION}.{f.name}", getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)  # frozen: normalise int -> float in place
        self._validate()

    def _validate(self) -> None:
        pass

    def _fail(self, key: str, why: str) -> None:
        raise JaxspecError(f"{self.SECTION}.{key}={short(getattr(self, key))} is invalid: {why}")

    @classmethod
    def subsections(cls) -> dict[str, type[Section]]:
        """Nested sections by key: fields typed as a Section (a subclass may add more)."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if is_section(hints[f.name])}

    @classmethod
    def leaf_keys(cls) -> list[str]:
        subs = cls.subsections()
        return [f.name for f in dataclasses.fields(cls) if f.name not in subs]


def is_section(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Section)


def as_dict(section: Any) -> Any:
    """A section as nested plain data (what YAML would hold)."""
    if not dataclasses.is_dataclass(section):
        return section
    return {f.name: as_dict(getattr(section, f.name)) for f in dataclasses.fields(section)}


# ---- type checks ---------------------------------------------------------------------------
def coerce(name: str, value: Any, hint: Any) -> Any:
    """Return `value` converted to `hint` (int -> float, numeric strings -> float) or raise."""
    options = type_options(hint)
    for t in options:
        if t is float and isinstance(value, str):
            try:
                value = float(value)  # PyYAML reads 1e-3 as a string
            except ValueError:
                continue
        if matches(value, t):
            return float(value) if t is float else value
    if isinstance(value, str) and any(typing.get_origin(o) is Literal for o in options):
        raise JaxspecError(f"{name}={short(value)} is invalid: use {describe(options)}")
    raise JaxspecError(f"{name}={short(value)} has the wrong type: expected {describe(options)}")


def type_options(hint: Any) -> list[Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [o for a in typing.get_args(hint) for o in type_options(a)]
    return [hint]


def matches(value: Any, hint: Any) -> bool:
    if any(o is not hint for o in type_options(hint)):
        return any(matches(value, o) for o in type_options(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def accepts_str(hint: Any) -> bool:
    return str in type_options(hint)


def describe(options: list[Any]) -> str:
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    out = []
    for o in options:
        if o is type(None):
            out.append("null")
        elif typing.get_origin(o) is Literal:
            out.append(f"one of {names(typing.get_args(o))}")
        else:
            out.append(words.get(o, getattr(o, "__name__", str(o))))
    return " or ".join(out)


def names(items) -> str:
    return ", ".join(str(i) for i in items)
