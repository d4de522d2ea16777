"""Where a verb writes (`--out`, `--plot`, `--png`), checked before any work starts (the writer of a
graph + external-data pair, `export --out X` -> X and X.data, is engine_dir.graph_pair_atomically).

A path the user gives us to write is refused, in one line naming the fix, when:
  - it is empty, or names no file or folder of its own ('.', '..', '/');
  - its last part is longer than the file system's names may be, with room for our temp and lock
    names beside it (NAME_MAX - TEMP_ROOM);
  - a part on the way exists and is not a folder (a file's child);
  - it exists and is of the wrong kind (a folder where a file is written, or the other way round),
    or is not a regular file (a device such as /dev/null, a FIFO, a symlink): we never write through
    such a thing, `--force` or not.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from enginesmith.core.errors import UserError

NAME_MAX = 255           # bytes in one path component (Linux, macOS)
TEMP_ROOM = 40           # what our temp and lock names add to the name: ".<name>.tmp-<pid>-<random>"
MAX_NAME = NAME_MAX - TEMP_ROOM


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    return ("a folder" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a file")


def check_out(text: str | os.PathLike, flag: str, want: str = "file") -> Path:
    """The path of `flag` (a "file" or a "dir" to create or replace), after the checks of the module
    docstring that do not depend on --force. Returns it as a Path (~ expanded)."""
    raw = os.fspath(text)
    if raw == "" or raw.strip() == "":
        raise UserError(f"{flag} is empty", f"give {flag} a {'folder' if want == 'dir' else 'file'} path")
    if "\0" in raw:
        raise UserError(f"{flag} {raw!r} holds a NUL character", f"give {flag} a plain path")
    path = Path(raw).expanduser()
    name = path.name
    if name in ("", ".", "..") or raw.endswith(("/.", "/..")):
        raise UserError(f"{flag} {raw!r} names no {'folder' if want == 'dir' else 'file'} of its own",
                        f"give {flag} a new name, e.g. {flag} ./{'engine' if want == 'dir' else 'model.onnx'}")
    if len(os.fsencode(name)) > MAX_NAME:
        raise UserError(f"{flag}: the name {name[:40]!r}... is {len(os.fsencode(name))} bytes; names may have at "
                        f"most {MAX_NAME} here (the file system's {NAME_MAX}, less room for temp names)",
                        f"give {flag} a shorter name")
    _check_ancestors(path, flag)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise UserError(f"{flag} {raw}: cannot be inspected ({exc.strerror})", f"give {flag} another path") from None
    wanted = stat.S_ISDIR(st.st_mode) if want == "dir" else stat.S_ISREG(st.st_mode)
    if not wanted:
        noun = "a directory" if want == "dir" else "a regular file"
        raise UserError(f"{flag} {raw} is {_kind(st)}, not {noun}; enginesmith never writes into anything else",
                        f"give {flag} another path")
    return path


def _check_ancestors(path: Path, flag: str) -> None:
    """Every existing part on the way to `path` is a folder (following links, as the OS will)."""
    for parent in reversed(path.absolute().parents):
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            return  # created on the way (mkdir -p)
        except OSError as exc:
            raise UserError(f"{flag} {path}: {parent} cannot be inspected ({exc.strerror})",
                            f"give {flag} another path") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"{flag} {path}: {parent} is {_kind(st)}, not a folder", f"give {flag} another path")


def check_new_file(path: Path, flag: str, force: bool) -> None:
    """An existing regular file at `path` is replaced only with --force."""
    if os.path.lexists(path) and not force:
        raise UserError(f"{path} already exists", f"pass --force to replace it, or give {flag} another path")
