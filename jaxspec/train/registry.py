"""The trained methods: method name -> its head class (init, loss, runtime, drafter, arch).

A leaf: each method's module registers itself here (`train.methods` the four heads,
`train.block` the block drafter); `train.load` and `train.train` import those modules.
"""

from __future__ import annotations

import dataclasses

METHODS: dict[str, type] = {}  # method name -> head class (init, loss, runtime, drafter, arch)


def register_method(name: str, cls: type) -> None:
    """Make `method: name` trainable (train configs) and loadable from its exported checkpoints.
    `cls` is a frozen dataclass; its fields named in a checkpoint's "arch" are restored from it."""
    if METHODS.get(name, cls) is not cls:
        raise ValueError(f"trained method '{name}' is already registered")
    METHODS[name] = cls


def from_arch(name: str, arch: dict):
    """The head of method `name` as exported with `arch` (its meta.json "arch"): the class's
    fields found there (lists back to tuples); the rest keep their defaults."""
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    tupled = lambda v: tuple(v) if isinstance(v, list) else v
    return cls(**{k: tupled(v) for k, v in arch.items() if k in fields})
