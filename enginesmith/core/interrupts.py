"""Ctrl-C and SIGTERM as exceptions that are never lost.

Inside `as_exceptions()` (the `enginesmith` command; write_atomically outside it) SIGINT raises
KeyboardInterrupt and SIGTERM raises Terminated, so every cleanup path runs: temp dirs, partial
outputs. Python ignores an exception raised inside a __del__ or a weakref callback, and a signal that
lands there (seen: regex's Group.__del__ during a build, on a loaded machine) would be swallowed while
the work goes on. So the handler also records the signal, and `raise_pending()` raises it again where
work is about to be made final (write_atomically and graph_pair_atomically, before they publish).
Meanwhile Python's report of the swallowed exception ("Exception ignored in ...", a traceback) is
left out: the signal is not lost, and the command ends with its one line.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every cleanup path runs."""


_pending: list[int] = []   # the signals raised since the outermost as_exceptions() began


def _raise(signum, frame):
    _pending.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _quiet_about_interrupts(unraisable, default=sys.__unraisablehook__) -> None:
    """sys.unraisablehook inside as_exceptions(): a recorded signal's exception is not reported."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        default(unraisable)


def raise_pending() -> None:
    """Raise a Ctrl-C or SIGTERM that arrived inside as_exceptions(), even one whose exception was swallowed."""
    if _pending:
        raise Terminated() if signal.SIGTERM in _pending else KeyboardInterrupt()


@contextlib.contextmanager
def as_exceptions() -> Iterator[None]:
    """SIGINT and SIGTERM raise inside (and are recorded). A signal someone else handles, or one inherited
    as ignored (a background job), stays as it is; outside the main thread nothing changes."""
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:
                signal.signal(sig, _raise)
                installed.append((sig, default))
    hook = sys.unraisablehook
    if installed:
        sys.unraisablehook = functools.partial(_quiet_about_interrupts, default=hook)
    if len(installed) == 2:
        _pending.clear()  # the outermost: what an earlier command in this process saw is not ours
    try:
        yield
    finally:
        for sig, default in installed:
            if signal.getsignal(sig) is _raise:  # a handler put there since (main's SIG_IGN after a signal) stays
                signal.signal(sig, default)
        if installed:
            sys.unraisablehook = hook
