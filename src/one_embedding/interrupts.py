"""Ctrl-C that always stops a training run.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread runs Python code
next. When that is a callback inside a compiled extension, the extension may lose it: numba's
dispatcher returns its result anyway, and Python reports ``SystemError: CPUDispatcher(...)
returned a result with an exception set`` (the interrupt as its ``__cause__``); code that clears
errors it did not expect drops it altogether, and the run goes on as if no key was pressed.
Measured on the 2-core VM (2026-12-07): of 95 Ctrl-Cs sent at random moments of 60-step
``train`` runs, one became that SystemError (exit 1 with a traceback, no resume command), and
one suite run saw a run exit 0 after its Ctrl-C.

``CtrlC`` notes every SIGINT as well as raising it, so the training loop raises it again at the
next step boundary (``check``) if it was lost; ``interrupt_of`` finds the interrupt behind such a
SystemError. A Ctrl-C inside a finalizer is lost too (Python prints it as ignored): a data
loader's generator left to the collector joins its read-ahead thread there, so the trainer
closes the ones it leaves early itself (``iterating``).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterable, Iterator


class CtrlC:
    """A context for the main thread: SIGINT raises ``KeyboardInterrupt`` as Python's default
    handler does, and also sets ``pressed``, which ``check`` turns into a ``KeyboardInterrupt``
    (the one raised may have been lost). The previous handler comes back on exit. Does nothing
    off the main thread, or where a handler other than Python's default is installed (the
    caller's own: it decides what Ctrl-C means)."""

    def __init__(self):
        self.pressed = False
        self._previous = None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._noted)
        return self

    def _noted(self, signum, frame) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed inside this context."""
        if self.pressed:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> bool:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False


def interrupt_of(error: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``error``: ``error`` itself when it is a ``KeyboardInterrupt``, the
    ``KeyboardInterrupt`` a compiled extension turned into a ``SystemError`` (CPython makes it
    the SystemError's cause), else None."""
    if isinstance(error, KeyboardInterrupt):
        return error
    if isinstance(error, SystemError) and isinstance(error.__cause__, KeyboardInterrupt):
        return error.__cause__
    return None


@contextlib.contextmanager
def iterating(iterable: Iterable) -> Iterator[Iterator]:
    """``iter(iterable)``, closed on leaving the ``with`` (where it has ``close``: a generator),
    so that its cleanup (a loader joining its read-ahead thread) runs here, where a Ctrl-C is
    raised, and not when the collector finalizes it, where it is printed and dropped."""
    it = iter(iterable)
    try:
        yield it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
