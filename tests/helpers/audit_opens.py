"""Which files does a piece of code open? A CPython audit hook records every `open` event (builtins
open, os.open, io.open_code) of this process while `opened_under` runs, so tests can assert that a
file outside an engine directory was never read, instead of assuming it. C extensions that call
open(2) directly bypass the hook: the loader under test opens through Python before any of them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

_OPENED: list[str] = []
_ACTIVE: list[bool] = []


def _audit(event: str, args: tuple) -> None:
    if _ACTIVE and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # hooks cannot be removed; this one records only inside opened_under


def opened_under(path: Path, fn: Callable[[], object]) -> list[str]:
    """Run fn() and return the files at or under `path` that it opened."""
    _OPENED.clear()
    _ACTIVE.append(True)
    try:
        fn()
    finally:
        _ACTIVE.clear()
    root = os.path.abspath(path)
    return [p for p in _OPENED if p == root or p.startswith(root + os.sep)]
