"""Progress lines on stderr for the waits a user would otherwise sit through in silence: loading a
model, compiling a decode program, a benchmark's warm-up, a step-cost calibration.

    with progress.step("compiling decode program (first run of this shape; cached afterwards)"):
        ...
    # stderr:  jaxspec: compiling decode program (first run of this shape; cached afterwards) ...
    #          jaxspec: compiling decode program (...): done in 41.2 s

Each step is two whole lines (start, then done with its elapsed time), so a step that fails or a
message printed in between never leaves a half-written line. On by default where a person is
watching (stderr is a terminal, or a Jupyter kernel), off when stderr is a pipe or a file, so
logs, `--json` runs and tests see only what they asked for; `JAXSPEC_PROGRESS=1` turns it on
everywhere, `JAXSPEC_PROGRESS=0` off. Nothing is ever written to stdout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
PREFIX = "jaxspec: "


def enabled() -> bool:
    """JAXSPEC_PROGRESS=1/0 decides; unset: on for a terminal or a Jupyter kernel."""
    flag = os.environ.get("JAXSPEC_PROGRESS", "").strip().lower()
    if flag in ("1", "on", "true", "yes"):
        return True
    if flag in ("0", "off", "false", "no"):
        return False
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def _line(text: str) -> None:
    sys.stderr.write(f"{PREFIX}{text}\n")
    sys.stderr.flush()


def note(message: str) -> None:
    """One line, now (when progress is on)."""
    if enabled():
        _line(message)


class Started:
    """A step under way: call it when the step is over (`outcome` says how it ended)."""

    def __init__(self, message: str):
        self.message, self.on, self.start = message, enabled(), time.perf_counter()
        if self.on:
            _line(f"{message} ...")

    def __call__(self, outcome: str = "done") -> float:
        """Print the elapsed time (the first call only); returns it in seconds."""
        elapsed = time.perf_counter() - self.start
        if self.on:
            self.on = False
            _line(f"{self.message}: {outcome} in {elapsed:.1f} s")
        return elapsed


def start(message: str) -> Started:
    """Announce `message` now; calling the result prints how long it took."""
    return Started(message)


@contextlib.contextmanager
def step(message: str) -> Iterator[None]:
    """Announce `message` now and its elapsed time when the block ends (or that it failed)."""
    finish = start(message)
    outcome = "failed"
    try:
        yield
        outcome = "done"
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        finish(outcome)


def compiling(batch: int, method: str) -> Started:
    """The engine's announcement before it compiles a request shape's prefill and decode."""
    return start(
        f"compiling decode program ({method}, batch {batch}; first run of this shape, "
        "cached afterwards)"
    )


def bar(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
    """`items` with a tqdm bar on stderr (when progress is on); the items themselves otherwise."""
    if not enabled():
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"{PREFIX}{description}", total=total, file=sys.stderr)
