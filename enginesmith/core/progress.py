"""Progress on stderr: bars in a terminal, plain lines in a log.

In a terminal, tqdm's bars redraw in place. Written to a file or a pipe, a redrawn bar is a run of
carriage returns (and a library's escape codes), so there each refresh becomes one plain line, at
most one every LOG_INTERVAL seconds (a stage change or the end is shown at once): a log reads top to
bottom, one line per stage, and a long benchmark still says now and then that it is alive.
"""

from __future__ import annotations

import io
import re
import sys
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL = 30.0  # seconds between a bar's lines in a log
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # ANSI escape sequences (cursor moves, colours)


def interactive(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default stderr) is a terminal."""
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class LogLines(io.TextIOBase):
    """A text stream that turns every redraw written to it into one plain line of `stream`."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> int:
        for part in re.split(r"[\r\n]", _CONTROL.sub("", text)):
            part = part.strip()
            if part and part != self.last:  # a bar closed after its last update redraws the same line
                self.stream.write(part + "\n")
                self.stream.flush()
                self.last = part
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def bar(**kwargs: Any) -> tqdm:
    """A tqdm bar on stderr: redrawn in a terminal; in a log, one line a refresh, at most every
    LOG_INTERVAL seconds (kwargs as tqdm's; `file` is chosen here)."""
    if interactive():
        return tqdm(file=sys.stderr, **kwargs)
    kwargs["mininterval"] = max(float(kwargs.get("mininterval", 0) or 0), LOG_INTERVAL)
    return tqdm(file=LogLines(sys.stderr), ascii=True, **kwargs)


def say(text: str) -> None:
    """A line on stderr that does not land inside a bar being drawn (tqdm.write moves it aside)."""
    tqdm.write(text, file=sys.stderr)
    sys.stderr.flush()
