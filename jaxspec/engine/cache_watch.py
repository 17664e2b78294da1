"""What the persistent XLA cache answered while a block ran: which programs it handed back
compiled (hits) and which it did not have, so they were compiled (misses). Progress messages say
"loading ... from the cache" or "compiling ..." from these answers, not from a guess.

    with cache_watch.watch(lambda name, hit: ...) as answers:
        lowered.compile()
    answers.hits, answers.misses, answers.summary(expected=2)

JAX reports each persistent-cache lookup as a DEBUG record of its compiler's logger (a hit before
the program is returned, a miss before it is compiled). While the block runs that logger is let
down to DEBUG and a filter on it reads those two records and keeps every DEBUG record from going
further (to the root's handlers), so a user's logging setup sees exactly what it saw before. With
no cache directory set (JAXSPEC_XLA_CACHE=0) every program compiles and nothing is looked up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from jaxspec.jax_compat import COMPILER_LOGGER  # the one module naming jax's internals

HIT = "persistent compilation cache hit for"
MISS = "persistent compilation cache miss for"


class Answers:
    """The cache's answers, in order, as (module name, hit)."""

    def __init__(self, on_lookup: Callable[[str, bool], None] | None):
        self.lookups: list[tuple[str, bool]] = []
        self.on_lookup = on_lookup
        self.lock = threading.Lock()
        self.cache_on = cache_enabled()

    @property
    def hits(self) -> list[str]:
        return [name for name, hit in self.lookups if hit]

    @property
    def misses(self) -> list[str]:
        return [name for name, hit in self.lookups if not hit]

    def record(self, name: str, hit: bool) -> None:
        with self.lock:
            self.lookups.append((name, hit))
        if self.on_lookup is not None:
            self.on_lookup(name, hit)

    def summary(self) -> str:
        """How the programs came to be, for a progress line's outcome."""
        hits, misses = len(self.hits), len(self.misses)
        if not self.cache_on:
            return "compiled (the persistent cache is off)"
        if not self.lookups:
            return "ready (this jax did not report its cache lookups)"
        if not misses:
            return f"loaded {_programs(hits)} from the cache"
        if not hits:
            return f"compiled {_programs(misses)} (kept in the cache for the next run)"
        return f"compiled {_programs(misses)}, loaded {hits} from the cache"


def _programs(n: int) -> str:
    return f"{n} program" + ("" if n == 1 else "s")


def cache_enabled() -> bool:
    import jax

    return bool(jax.config.jax_compilation_cache_dir)


class _Reader(logging.Filter):
    """The one filter on the compiler logger while any watch is open: hands each lookup record
    to the watch of the thread that logged it (compiles log from the compiling thread)."""

    def __init__(self, floor: int):
        super().__init__()
        self.floor = floor
        self.by_thread: dict[int, Answers] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.floor:
            return True
        answers = self.by_thread.get(record.thread)
        text = str(record.msg).lower()
        if answers is not None and (text.startswith(HIT) or text.startswith(MISS)):
            name = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
            answers.record(name, text.startswith(HIT))
        return False  # below what the logger let through before: as if never logged


@contextlib.contextmanager
def watch(on_lookup: Callable[[str, bool], None] | None = None) -> Iterator[Answers]:
    """Record the persistent cache's answers to this thread's compiles while the block runs;
    `on_lookup(name, hit)` is called at each (before a missed program compiles)."""
    global _READER, _SAVED_LEVEL
    answers = Answers(on_lookup)
    logger = logging.getLogger(COMPILER_LOGGER)
    me = threading.get_ident()
    with _LOCK:  # the first open watch installs the filter, the last one removes it
        if _READER is None:
            _SAVED_LEVEL = logger.level
            _READER = _Reader(logger.getEffectiveLevel())
            logger.addFilter(_READER)
            logger.setLevel(min(logging.DEBUG, _READER.floor))
        reader = _READER
        outer = reader.by_thread.get(me)
        reader.by_thread[me] = answers
    try:
        yield answers
    finally:
        with _LOCK:
            if outer is not None:
                reader.by_thread[me] = outer
            else:
                reader.by_thread.pop(me, None)
            if not reader.by_thread:
                logger.removeFilter(reader)
                logger.setLevel(_SAVED_LEVEL)
                _READER = None


_LOCK = threading.Lock()
_READER: _Reader | None = None
_SAVED_LEVEL = logging.NOTSET


def announcer(started, expected: int) -> Callable[[str, bool], None]:
    """An `on_lookup` that tells a progress.Started step which program of how many is being
    loaded or compiled (`expected`: how many programs the step compiles)."""
    seen = [0]

    def on_lookup(name: str, hit: bool) -> None:
        seen[0] += 1
        k, n = seen[0], max(expected, seen[0])
        if hit:
            started.update(f"loaded program {k} of {n} ({name}) from the cache")
        else:
            started.update(f"compiling program {k} of {n} ({name}; not in the cache)")

    return on_lookup
