"""A manifest of a directory we wrote (size and sha256 of every file), checked before we trust it.

The converted-model cache is written once and read by every later build; a file altered in it
(a disk error, a stray edit) would silently change every engine built from it. `write` records
the directory's files as the last step of making it; `problem` says what no longer matches, or
None. Only regular files and folders count: a symlink, FIFO or device in the directory is a
mismatch (a FIFO would hang the hash). Sizes are compared before anything is hashed, and a file's
hash is remembered for the life of the process, keyed by (device, inode, size, mtime, ctime), so
a second check in one process costs a few stat calls.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

NAME = "enginesmith-files.json"
FORMAT = 1
MAX_FILES = 256               # a converted checkpoint holds about ten
MAX_MANIFEST_BYTES = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")

_HASHES: dict[tuple, str] = {}  # (dev, ino, size, mtime_ns, ctime_ns) -> sha256


class _Mismatch(Exception):
    """Why a directory does not match its manifest (internal: `problem` returns the text)."""


def _sha256(path: Path, st: os.stat_result) -> str:
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def _listing(root: Path) -> dict[str, tuple[Path, os.stat_result]]:
    """Every regular file under root (but the manifest), by relative posix path, with its lstat."""
    found: dict[str, tuple[Path, os.stat_result]] = {}
    pending = [root]
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                path = Path(entry.path)
                rel = path.relative_to(root).as_posix()
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(path)
                elif not stat.S_ISREG(st.st_mode):
                    raise _Mismatch(f"{rel} is not a regular file")
                elif rel != NAME:
                    found[rel] = (path, st)
                if len(found) > MAX_FILES:
                    raise _Mismatch(f"it holds more than {MAX_FILES} files")
    return found


def write(root: Path, **meta: str) -> None:
    """Record every file under `root` (and `meta`) in root/NAME. Call it last, before the rename."""
    root = Path(root)
    files = {rel: {"size": st.st_size, "sha256": _sha256(path, st)}
             for rel, (path, st) in sorted(_listing(root).items())}
    (root / NAME).write_text(json.dumps({"format": FORMAT, **meta, "files": files}, indent=1) + "\n")


def _read(root: Path) -> dict:
    path = root / NAME
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise _Mismatch(f"its manifest {NAME} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Mismatch(f"{NAME} is not a regular file")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise _Mismatch(f"{NAME} is {st.st_size} bytes")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _Mismatch(f"{NAME} is not valid JSON") from None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(files, dict) or not all(
            isinstance(rec, dict) and isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)
            and _SHA256.fullmatch(rec["sha256"]) for rec in files.values()):
        raise _Mismatch(f"{NAME} is not a manifest of format {FORMAT}")
    return data


def _check(root: Path, meta: dict[str, str]) -> None:
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise _Mismatch("it does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _Mismatch("it is not a directory")
    manifest = _read(root)
    for key, value in meta.items():
        if manifest.get(key) != value:
            raise _Mismatch(f"its manifest records another {key}")
    expected: dict[str, dict] = manifest["files"]
    present = _listing(root)
    for rel in sorted(set(expected) - set(present)):
        raise _Mismatch(f"{rel} is missing")
    for rel in sorted(set(present) - set(expected)):
        raise _Mismatch(f"{rel} is not in its manifest")
    for rel, (_, st) in sorted(present.items()):  # sizes first: cheap, and catch truncation
        if st.st_size != expected[rel]["size"]:
            raise _Mismatch(f"{rel} has {st.st_size} bytes, not {expected[rel]['size']}")
    for rel, (path, st) in sorted(present.items()):
        if _sha256(path, st) != expected[rel]["sha256"]:
            raise _Mismatch(f"{rel} differs from its recorded sha256")


def problem(root: Path, **meta: str) -> str | None:
    """None when `root` holds exactly the files its manifest lists, of the same sizes and hashes,
    and the manifest records `meta`; else a short reason ("model.safetensors was altered ...")."""
    try:
        _check(Path(root), meta)
    except _Mismatch as exc:
        return str(exc)
    except OSError as exc:  # unreadable: as good as altered; rebuilding tells the user if it is the disk
        return f"it cannot be read ({exc.strerror or exc})"
    return None
