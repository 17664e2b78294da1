"""Progress on stderr for the waits a user would otherwise sit through in silence: loading a model,
compiling (or loading from the cache) the decode programs, a benchmark's warm-up, a calibration.

    with progress.step("loading smollm2-135m"):
        ...
    # a terminal:  one live line, `jaxspec: loading smollm2-135m ... 12 s`, then
    #              `jaxspec: loading smollm2-135m: done in 18.1 s`
    # a log, a pipe, CI, a notebook:  timestamped whole lines, at each step and every 10 s of a
    #              long one: `06:08:26 jaxspec: loading smollm2-135m: 10 s so far`

On by default wherever output goes; off with the CLI's `--quiet`, `JAXSPEC_PROGRESS=0`, or in
Python by silencing the `jaxspec` logger (`logging.getLogger("jaxspec").setLevel("WARNING")`):
every line is a record of that logger (INFO), written by its own handler to the stderr of the
moment (so the logger does not propagate to the root's handlers; replace its handler to route
the lines elsewhere). Nothing is ever written to stdout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
PREFIX = "jaxspec: "
LOG = logging.getLogger("jaxspec")
TICK_S = 1.0  # a terminal's live line is redrawn this often
QUIET_TICK_S = 10.0  # elsewhere a long step prints a line this often

# transformers and huggingface_hub import tqdm.auto, which warns in a Jupyter kernel without
# ipywidgets; jaxspec's own progress is plain lines, so that warning is noise.
warnings.filterwarnings("ignore", message="IProgress not found")


def _live() -> bool:
    """A terminal: one line redrawn in place; anything else gets whole, timestamped lines."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class _StderrHandler(logging.Handler):
    """Writes each record as one line to the current sys.stderr (looked up at each write, so
    redirections and test captures see it), clearing a live line first."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with _TICKER.lock:
                _TICKER.clear_live()
                if _live():
                    sys.stderr.write(f"{PREFIX}{record.getMessage()}\n")
                else:
                    stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
                    sys.stderr.write(f"{stamp} {PREFIX}{record.getMessage()}\n")
                sys.stderr.flush()
        except Exception:  # a closed stderr must not break generation
            self.handleError(record)


if not any(isinstance(h, _StderrHandler) for h in LOG.handlers):
    LOG.addHandler(_StderrHandler())
    LOG.propagate = False
    if LOG.level == logging.NOTSET:
        LOG.setLevel(logging.INFO)

_quiet = False


def set_quiet(quiet: bool = True) -> None:
    """Turn progress off (the CLI's `--quiet`) or back on, for this process."""
    global _quiet
    _quiet = quiet


def enabled() -> bool:
    """On unless `--quiet`, JAXSPEC_PROGRESS=0, or the `jaxspec` logger is silenced."""
    if _quiet or os.environ.get("JAXSPEC_PROGRESS", "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return LOG.isEnabledFor(logging.INFO)


def note(message: str) -> None:
    """One line, now (when progress is on)."""
    if enabled():
        LOG.info(message)


class Started:
    """A step under way: `update` says what it is doing now; call it when the step is over
    (`outcome` says how it ended)."""

    def __init__(self, message: str, announce: bool = True):
        self.message, self.detail = message, ""
        self.on, self.start = enabled(), time.perf_counter()
        self.last_line = self.start
        self.shown = announce  # a silent step speaks only once it is long (a status line)
        if self.on:
            if announce:
                LOG.info(f"{message} ...")
            _TICKER.push(self)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, detail: str, line: bool = True) -> None:
        """What the step is doing now: the live line on a terminal; elsewhere a line of its own
        (`line`), or the next 10-second status line."""
        self.detail = detail
        if self.on and line and not _live():
            self.last_line = time.perf_counter()
            LOG.info(self.status())

    def status(self) -> str:
        if self.detail:
            return f"{self.message}: {self.detail} ({self.elapsed():.0f} s so far)"
        return f"{self.message}: {self.elapsed():.0f} s so far"

    def __call__(self, outcome: str = "done") -> float:
        """Print the elapsed time (the first call only); returns it in seconds."""
        elapsed = self.elapsed()
        if self.on:
            self.on = False
            _TICKER.pop(self)
            if self.shown:
                LOG.info(f"{self.message}: {outcome} in {elapsed:.1f} s")
            else:
                with _TICKER.lock:
                    _TICKER.clear_live()
        return elapsed


class _Ticker:
    """One daemon thread for the open steps: redraws a terminal's live line every second, or
    prints the innermost step's status every 10 s of silence elsewhere."""

    def __init__(self):
        self.lock = threading.RLock()
        self.steps: list[Started] = []
        self.shown = False  # a live line is on screen (no newline yet)
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()  # a new step: tick from now, not from the last sleep

    def push(self, step: Started) -> None:
        with self.lock:
            self.steps.append(step)
            self.wake.set()
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self.run, name="jaxspec-progress", daemon=True)
                self.thread.start()

    def pop(self, step: Started) -> None:
        with self.lock:
            if step in self.steps:
                self.steps.remove(step)

    def clear_live(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            self.shown = False

    def run(self) -> None:
        while True:
            if self.wake.wait(TICK_S):
                self.wake.clear()
                continue
            with self.lock:
                if not self.steps:
                    self.clear_live()
                    self.thread = None
                    return
                step = self.steps[-1]
                try:
                    if _live():
                        sys.stderr.write(f"\r\033[K{PREFIX}{step.status()}")
                        sys.stderr.flush()
                        self.shown = True
                    elif time.perf_counter() - step.last_line >= QUIET_TICK_S:
                        step.last_line = time.perf_counter()
                        step.shown = True
                        LOG.info(step.status())
                except Exception:  # a closed stderr ends the ticking, never the program
                    self.steps.clear()


_TICKER = _Ticker()


def start(message: str, announce: bool = True) -> Started:
    """Announce `message` now; calling the result prints how long it took. `announce=False`:
    nothing unless the step runs long (a live line, or a status line every 10 s)."""
    return Started(message, announce)


def stop() -> None:
    """End every open step silently and clear a live line: before an error line, so the error
    is the only line a failed command leaves."""
    with _TICKER.lock:
        _TICKER.steps.clear()
        _TICKER.clear_live()


@contextlib.contextmanager
def step(message: str) -> Iterator[Started]:
    """Announce `message` now and its elapsed time when the block ends (or that it failed)."""
    finish = start(message)
    outcome = "failed"
    try:
        yield finish
        outcome = "done"
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        finish(outcome)


def bar(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
    """`items` with a tqdm bar on a terminal, a line per item elsewhere (when progress is on)."""
    if not enabled():
        return items
    if _live():
        from tqdm.std import tqdm  # never tqdm's notebook flavour (it warns without ipywidgets)

        return tqdm(items, desc=f"{PREFIX}{description}", total=total, file=sys.stderr)
    return _lines(items, description, total)


def _lines(items: Iterable[T], description: str, total: int | None) -> Iterator[T]:
    with step(description) as started:
        for i, item in enumerate(items):
            yield item
            started.update(f"{i + 1} of {total}" if total else f"{i + 1} done", line=False)
