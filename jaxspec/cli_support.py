"""What every jaxspec command line shares: an argument parser whose mistakes are one-line
`JaxspecError`s (printed as `error: ...`, exit 2), `run` (the exit-status contract every entry
point and the server use: user errors one line and exit 2, Ctrl-C exit 130 at any moment), and
the persistent XLA compilation cache."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from jaxspec import progress, xla_cache
from jaxspec.errors import JaxspecError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
# After Ctrl-C, how long the main thread may stay inside native code (an XLA compilation, a
# device call) before the process exits from the watcher thread instead.
INTERRUPT_GRACE_S = 2.0
# After the KeyboardInterrupt was raised, how long the command may take to clean up (bench
# writes its partial results) before the watcher exits anyway: native code that swallows the
# exception (seen in XLA compilation) must not let the run carry on.
CLEANUP_GRACE_S = 10.0


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage + exit; keep the one-line contract
        raise JaxspecError(f"{message} (see --help)")


def compilation_cache_dir() -> str | None:
    """<jaxspec cache>/xla; None when JAXSPEC_XLA_CACHE=0 turns it off (`jaxspec.xla_cache`)."""
    return xla_cache.directory()


def enable_compilation_cache() -> str | None:
    """Persist compiled XLA programs so the next run with the same shapes skips compilation."""
    return xla_cache.enable()  # also heals unreadable entries (xla_cache.drop_unreadable_entries)


def error_line(e: BaseException, limit: int = 2000) -> str:
    """`error: ...` on one line, bounded in length."""
    text = " ".join(str(e).split())
    return f"error: {text[:limit]}{' ...' if len(text) > limit else ''}"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def exit_now(status: int) -> None:
    """Flush and leave without interpreter teardown: after Ctrl-C, XLA's threads may still be
    compiling, and tearing the interpreter down under them crashed the process."""
    _flush()
    os._exit(status)


class _Interrupts:
    """SIGINT handling for `run`: the first Ctrl-C raises KeyboardInterrupt in the main thread
    (so a command can save partial results), and a watcher thread woken through the signal
    wakeup fd exits with 130 if the main thread is still inside native code (compiling) after
    INTERRUPT_GRACE_S, or has not finished its clean-up CLEANUP_GRACE_S after that; a second
    Ctrl-C exits at once. Exits skip interpreter teardown (`exit_now`)."""

    def __init__(self):
        self.count = 0
        self.handled = threading.Event()
        self.previous = None
        self.wakeup = None

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        import socket

        r, w = socket.socketpair()
        r.setblocking(True)
        w.setblocking(False)
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
            self.wakeup = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            return False
        self._sockets = (r, w)
        self.unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        threading.Thread(target=self._watch, args=(r,), daemon=True, name="jaxspec-sigint").start()
        return True

    def uninstall(self) -> None:
        self._sockets[1].close()  # the watcher's recv sees EOF and the thread ends
        sys.unraisablehook = self.unraisable
        try:
            signal.set_wakeup_fd(self.wakeup if self.wakeup is not None else -1)
            signal.signal(signal.SIGINT, self.previous or signal.default_int_handler)
        except (ValueError, OSError, TypeError):
            pass

    def _handler(self, signum, frame):
        self.count += 1
        self.handled.set()
        if self.count > 1:
            print("\ninterrupted", file=sys.stderr)
            exit_now(EXIT_INTERRUPTED)
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        """Ctrl-C that lands in a callback Python cannot raise from (JAX's gc callback): no
        traceback; the watcher thread ends the command as for any interrupt."""
        if unraisable.exc_type is not KeyboardInterrupt:
            self.unraisable(unraisable)

    def _watch(self, r) -> None:
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                r.close()
                return
            if signal.SIGINT not in data:
                continue
            self.handled.wait(INTERRUPT_GRACE_S)  # unset: the main thread is in native code
            if self.handled.is_set():
                time.sleep(CLEANUP_GRACE_S)  # the command's own clean-up, then leave regardless
            print("\ninterrupted", file=sys.stderr)
            exit_now(EXIT_INTERRUPTED)


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run an entry point's `main(argv)` under the CLI contract and return its exit status:
    a `JaxspecError` (or a file the user named that cannot be read) prints one `error:` line
    and gives 2; Ctrl-C at any moment exits 130 without a traceback (see `_Interrupts`); a
    closed stdout (`| head`) ends quietly. Used by every `python -m jaxspec.*` and the server."""
    interrupts = _Interrupts()
    installed = interrupts.install()
    try:
        status = main(argv)
        if interrupts.count:  # main caught the KeyboardInterrupt itself (bench saves partial results)
            exit_now(status)
        return status
    except JaxspecError as e:
        progress.stop()
        print(error_line(e), file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        progress.stop()
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        print(error_line(f"cannot open{where}: {e.strerror or e}: check the path"), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        if installed:
            exit_now(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `... | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 0
    finally:
        if installed:
            interrupts.uninstall()
