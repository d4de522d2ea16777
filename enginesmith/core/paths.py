"""Where enginesmith keeps its caches (engines built on first use, corpus token caches), and the one
place that turns "this place cannot be written" into a user error."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator

from enginesmith.core.errors import UserError

# errno values that mean the place we write to is unusable (not a bug of ours), with the words we show
_UNWRITABLE = {
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space is left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "a folder on the way does not exist",
    errno.ENOTDIR: "a part of the path is not a folder",
}


def cache_dir() -> Path:
    """$ENGINESMITH_CACHE, else $XDG_CACHE_HOME/enginesmith, else ~/.cache/enginesmith."""
    env = os.environ.get("ENGINESMITH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "enginesmith"


def cache_fix(gb: float) -> str:
    """The fix for an unwritable cache: where to point it instead."""
    return f"set ENGINESMITH_CACHE to a writable directory with {gb:g} GB free"


def _on_the_way(name: object, root: Path) -> bool:
    """Whether the file an OSError names is `root`, under it, or one of the folders above it."""
    if not isinstance(name, (str, bytes, os.PathLike)):
        return False
    try:
        here = Path(os.fsdecode(name)).absolute()
    except (TypeError, ValueError):
        return False
    return here == root or root in here.parents or here in root.parents


@contextlib.contextmanager
def writing_to(path: str | os.PathLike, what: str, fix: str | None = None, gb: float = 1) -> Iterator[None]:
    """Run a block that creates or writes files under `path`.

    An OSError of that block which says the place cannot be written (read-only, full, over quota,
    no permission, a missing or non-folder parent: EROFS ENOSPC EDQUOT EACCES EPERM ENOENT ENOTDIR)
    and is about `path`, a file under it or a folder above it (or names no file, as a failed
    write() does) becomes
    ``UserError("cannot write <what> in <path>: <reason> (<file>)", fix)``. `fix` defaults to
    `cache_fix(gb)`. Any other error passes through unchanged (a missing input file is not a full disk).
    """
    root = Path(path).absolute()
    try:
        yield
    except OSError as exc:
        reason = _UNWRITABLE.get(exc.errno) if exc.errno is not None else None
        names = [n for n in (exc.filename, exc.filename2) if n is not None]
        if reason is None or (names and not any(_on_the_way(n, root) for n in names)):
            raise
        where = f" ({os.fsdecode(names[0])})" if names and Path(os.fsdecode(names[0])).absolute() != root else ""
        raise UserError(f"cannot write {what} in {root}: {reason}{where}", fix or cache_fix(gb)) from None
