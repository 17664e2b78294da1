"""The trained methods: method name -> its head class (init, loss, runtime, drafter, arch).

A trained method is registered once, with its drafter: `register_drafter(name, ...,
train="module:Class", formats=...)` (jaxspec.drafters.registry). This module resolves those
names to classes, importing a head's module only when training or loading asks for it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping

import jaxspec.drafters  # noqa: F401 -- importing it registers the built-in methods
from jaxspec.drafters.registry import trained_methods


class _Heads(Mapping):
    """A read-only view: trained method name -> head class, resolved on lookup."""

    def __getitem__(self, name: str) -> type:
        module, attr = trained_methods()[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def __iter__(self) -> Iterator[str]:
        return iter(trained_methods())

    def __len__(self) -> int:
        return len(trained_methods())


METHODS: Mapping[str, type] = _Heads()


def from_arch(name: str, arch: dict):
    """The head of method `name` as exported with `arch` (its meta.json "arch"): the class's
    fields found there (lists back to tuples); the rest keep their defaults."""
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    tupled = lambda v: tuple(v) if isinstance(v, list) else v
    return cls(**{k: tupled(v) for k, v in arch.items() if k in fields})
