"""The server's programs compiled once and kept whole, so a warm restart neither traces nor
lowers them. XLA's persistent cache is keyed by the lowered program, so finding a program there
still costs its tracing and lowering (measured on the SmolLM2 server: ~75% of a warm restart,
17-40 s a decode program under load); here each compiled executable is serialized
(`jax.experimental.serialize_executable`) under a key made without tracing: the program's
function, the tree and shapes of its arguments, and a fingerprint of everything else that
shapes it (the config, jaxspec's source, jax's version, the devices, the code-generation
flags). A warm restart loads each in well under a second.

`Table.call` runs a jitted function's call through the executable compiled for its arguments
(the same function, static arguments and shapes), else through the jit as before: the engine's
serving surface calls through it when a table is set (`Engine.serving_programs`). Calls stay
exact: the executable is the one the jit would have compiled for these arguments.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import jax

from jaxspec import jax_compat
from jaxspec.options import as_dict

STATIC_KWARGS = ("capacity",)  # the serving programs' static keyword arguments
VERSION = 1  # of the file format


def _split(args, kwargs):
    """(static values, dynamic args, dynamic kwargs): the first positional argument of every
    serving program (its spec or target) and `capacity` are static; None keywords are dropped
    (the programs' defaults)."""
    static = (args[0],) + tuple(kwargs[k] for k in STATIC_KWARGS if k in kwargs)
    dynamic = {k: v for k, v in kwargs.items() if k not in STATIC_KWARGS and v is not None}
    return static, tuple(args[1:]), dynamic


def _avals(leaves) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def source_hash() -> str:
    """A hash of jaxspec's own source (a program changes when the code does)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(config) -> str:
    """What shapes a server's programs besides their arguments' shapes."""
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("XLA_", "JAXSPEC_TEST_FAST", "JAX_ENABLE", "JAX_DEFAULT"))}
    parts = {"version": VERSION, "config": as_dict(config), "source": source_hash(),
             "jax": jax.__version__, "devices": [str(d.device_kind) for d in jax.devices()],
             "backend": jax.default_backend(), "env": env}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def _xla_cache_unread():
    """On CPU, a compile with XLA's persistent cache off (`jax_compat`): an executable it gives
    back serializes without some of its kernels, and the store's copy of it fails when it runs
    ("Function copy_bitcast_fusion.299 not found": seen on the SmolLM2 server restarted after a
    source change, which re-keys the store while the XLA cache still holds the programs)."""
    if jax.default_backend() != "cpu":
        yield
        return
    with jax_compat.compilation_cache_disabled():
        yield


class Table:
    """Compiled serving programs by (function, static arguments, argument tree and shapes)."""

    def __init__(self, directory: str | None, fingerprint: str):
        self.directory = None if directory is None else Path(directory)
        self.fingerprint = fingerprint
        self.compiled: dict = {}
        self.hits = self.misses = 0

    def _keys(self, fn, args, kwargs):
        static, dyn, dkw = _split(args, kwargs)
        leaves, tree = jax.tree.flatten((dyn, dkw))
        avals = _avals(leaves)
        memory = (fn, static, tree, avals)
        name = getattr(fn, "__name__", repr(fn))
        text = json.dumps([self.fingerprint, name, _no_addresses(repr(static)), str(tree),
                           avals], default=str)
        return memory, hashlib.sha256(text.encode()).hexdigest()[:32]

    def prepare(self, program) -> str:
        """The program (jitted function, args, kwargs; abstract or concrete) loaded from the
        directory, else compiled (and saved there): -> "loaded" or "compiled"."""
        fn, args, kwargs = program
        memory, file_key = self._keys(fn, args, kwargs)
        if memory in self.compiled:
            return "loaded"
        exe = self._load(file_key)
        how = "loaded"
        if exe is None:
            with _xla_cache_unread():
                exe, how = fn.lower(*args, **kwargs).compile(), "compiled"
            self._save(file_key, exe)
        self.compiled[memory] = exe
        return how

    def call(self, fn, args, kwargs):
        """`fn(*args, **kwargs)` through the executable compiled for these arguments, else
        through the jit."""
        memory, _ = self._keys(fn, args, kwargs)
        exe = self.compiled.get(memory)
        if exe is None:
            self.misses += 1
            return fn(*args, **kwargs)
        _, dyn, dkw = _split(args, kwargs)
        try:
            out = exe(*dyn, **dkw)
        except TypeError:  # the arguments' types differ in a way the key missed (weak types)
            del self.compiled[memory]
            self.misses += 1
            return fn(*args, **kwargs)
        self.hits += 1
        return out

    def _path(self, file_key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{file_key}.exe"

    def _load(self, file_key: str):
        path = self._path(file_key)
        if path is None or not path.exists():
            return None
        from jax.experimental import serialize_executable

        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception:  # noqa: BLE001 -- a damaged or foreign entry: compiled again
            path.unlink(missing_ok=True)
            return None

    def _save(self, file_key: str, exe) -> None:
        path = self._path(file_key)
        if path is None:
            return
        from jax.experimental import serialize_executable

        try:
            data = pickle.dumps(serialize_executable.serialize(exe))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(path)  # whole or absent: a killed writer leaves no half entry
        except Exception:  # noqa: BLE001 -- not serializable here: the table still holds it
            pass
