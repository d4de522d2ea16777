"""A Ctrl-C or SIGTERM is never lost (enginesmith/core/interrupts.py). Python ignores an exception raised
inside a __del__ ("Exception ignored in ..."), and a build once went on to publish its engine, exit 0,
after a Ctrl-C landed in regex's Group.__del__. The handler records the signal, and write_atomically
raises it again before it publishes: nothing is written, and the signal's own exception comes out."""

from __future__ import annotations

import signal
import sys

import pytest

from enginesmith.core import engine_dir, interrupts


class RaisesInDel:
    """Delivers `sig` to this process from inside __del__, where Python swallows what the handler raises."""

    def __init__(self, sig: int) -> None:
        self.sig = sig

    def __del__(self) -> None:
        signal.raise_signal(self.sig)


@pytest.fixture
def default_handlers():
    """SIGINT and SIGTERM as a fresh process has them (as_exceptions takes over only those)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, interrupts.Terminated)])
def test_a_signal_swallowed_in_a_del_still_stops_the_write(default_handlers, tmp_path, monkeypatch, sig, raised):
    ignored: list = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)  # where Python reports what it ignores
    target = tmp_path / "engine"
    with pytest.raises(raised) as caught:
        with engine_dir.write_atomically(target) as tmp:
            (tmp / "build.json").write_text("{}")
            RaisesInDel(sig)  # collected at once: the handler's exception is ignored here ...
            (tmp / "more").write_text("the work went on")  # ... and the work goes on
            assert ignored == []  # unreported (no traceback on the user's terminal): the signal is recorded
    assert type(caught.value) is raised
    assert list(tmp_path.iterdir()) == []  # nothing published, no temp dir left
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers given back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert sys.unraisablehook == ignored.append  # and the hook


def test_other_ignored_exceptions_are_still_reported(default_handlers, tmp_path, monkeypatch):
    class FailsInDel:
        def __del__(self):
            raise ValueError("a bug in a __del__")

    ignored: list = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    with engine_dir.write_atomically(tmp_path / "engine") as tmp:
        (tmp / "build.json").write_text("{}")
        FailsInDel()
    assert [type(u.exc_value) for u in ignored] == [ValueError]


def test_a_later_write_starts_clean(default_handlers, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    with pytest.raises(KeyboardInterrupt):
        with engine_dir.write_atomically(tmp_path / "first"):
            RaisesInDel(signal.SIGINT)
    with engine_dir.write_atomically(tmp_path / "second") as tmp:
        (tmp / "build.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["second"]
