"""Real text for accuracy measurements: Jane Austen's six novels, read from an installed package.

No text is ever downloaded. The corpus comes from the Debian package `r-cran-janeaustenr`, which
stores the novels in R's lazy-load format (`janeaustenr/data/Rdata.rdb` + `Rdata.rdx`); we read it
without R through PyPI `rdata`:

- `Rdata.rdx` is a compressed RDS file: a list whose `variables` map each name to (offset, length)
  in the `.rdb`;
- each `.rdb` blob is a 4-byte big-endian uncompressed length followed by a zlib stream holding one
  serialized R object, here a character vector with one element per line of the book.

Text layout: `austen_text()` joins the lines with "\\n" exactly as the package stores them (the
Project Gutenberg line wrapping at ~70 columns). Empty lines are kept, so a paragraph break is
"\\n\\n" and the title/chapter headings keep their blank lines around them; nothing is stripped or
re-flowed. This is the layout the reference perplexities in facts.md were measured on, and it is a
faithful view of the book as printed.
"""

from __future__ import annotations

import functools
import os
import stat
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np

from enginesmith.core.errors import UserError

PACKAGE = "janeaustenr"
INSTALL_FIX = "apt-get install -y --no-install-recommends r-cran-janeaustenr"
DEFAULT_NOVEL = "prideprejudice"
MAX_TEXT_BYTES = 1 << 30  # a --text / --calib-text file is read whole, then tokenized
# Where Debian/Ubuntu and a local R install put site libraries; $R_LIBS* entries are tried first.
_LIB_DIRS = ("/usr/lib/R/site-library", "/usr/local/lib/R/site-library", "/usr/lib/R/library")


def data_dir() -> Path:
    """The janeaustenr `data` directory holding Rdata.rdb/.rdx, or a UserError saying how to install it."""
    candidates = []
    for var in ("ENGINESMITH_JANEAUSTENR", "R_LIBS", "R_LIBS_SITE", "R_LIBS_USER"):
        for entry in filter(None, os.environ.get(var, "").split(os.pathsep)):
            root = Path(entry)
            candidates.append(root if var == "ENGINESMITH_JANEAUSTENR" else root / PACKAGE)
    candidates += [Path(d) / PACKAGE for d in _LIB_DIRS]
    for root in candidates:
        data = root / "data"
        if (data / "Rdata.rdb").is_file() and (data / "Rdata.rdx").is_file():
            return data
    raise UserError("the Jane Austen corpus (Debian package r-cran-janeaustenr) is not installed",
                    f"{INSTALL_FIX}, or give a UTF-8 text file of your own: --text FILE (eval, bench --requests, bench "
                    "serve) or --calib-text FILE (build)")


@functools.lru_cache(maxsize=1)
def _index() -> dict[str, tuple[int, int]]:
    import rdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = rdata.read_rds(data_dir() / "Rdata.rdx")
    return {str(name): (int(span[0]), int(span[1])) for name, span in index["variables"].items()}


def novels() -> list[str]:
    """Names of the novels in the corpus, sorted (e.g. "emma", "prideprejudice")."""
    return sorted(_index())


@functools.lru_cache(maxsize=8)
def austen_lines(novel: str = DEFAULT_NOVEL) -> tuple[str, ...]:
    """The novel's lines as the package stores them (empty strings are blank lines)."""
    import rdata

    index = _index()
    if novel not in index:
        raise UserError(f"unknown novel {novel!r}", f"use one of: {', '.join(sorted(index))}")
    offset, length = index[novel]
    with open(data_dir() / "Rdata.rdb", "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    if len(blob) != length or length < 4:
        raise UserError(f"{data_dir() / 'Rdata.rdb'} is truncated", f"reinstall: {INSTALL_FIX}")
    expected = struct.unpack(">I", blob[:4])[0]
    raw = zlib.decompress(blob[4:])
    if len(raw) != expected:
        raise UserError(f"{novel!r} in the janeaustenr data is corrupt", f"reinstall: {INSTALL_FIX}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
    # An R NA string would come back as None/NaN: treat it as an empty line.
    return tuple(str(x) if isinstance(x, str) else "" for x in obj)


def austen_text(novel: str = DEFAULT_NOVEL) -> str:
    """The whole novel as one string: lines joined with "\\n", blank lines kept (see module doc)."""
    return "\n".join(austen_lines(novel))


def load_text(path: str | os.PathLike | None = None, novel: str = DEFAULT_NOVEL) -> str:
    """The text of `path` (UTF-8) if given, else `austen_text(novel)`.

    Raises UserError when the file is missing, is not a file, is not UTF-8 or has no
    non-whitespace text, and when the corpus is needed but not installed.
    """
    if path is None:
        return austen_text(novel)
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"text file {str(path)!r} does not exist",
                        "pass an existing UTF-8 text file, or leave it out to use the Austen corpus")
    if not p.is_file():
        raise UserError(f"{str(path)!r} is not a file", "pass a UTF-8 text file")
    try:
        text = _read_bounded(p).decode("utf-8")
    except OSError as exc:  # /proc/self/mem (EIO), no permission, a file that vanished
        raise UserError(f"text file {str(path)!r} cannot be read ({exc.strerror or type(exc).__name__})",
                        "pass a readable UTF-8 text file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                        "convert it to UTF-8, e.g. iconv -t UTF-8") from None
    if not text.strip():
        raise UserError(f"text file {str(path)!r} is empty", "pass a file with some text in it")
    return text


def _read_bounded(path: Path) -> bytes:
    """A regular file's bytes, at most MAX_TEXT_BYTES (a device or FIFO is refused, never blocked on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UserError(f"{str(path)!r} is not a regular file", "pass a UTF-8 text file")
        data = f.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise UserError(f"text file {str(path)!r} is larger than {MAX_TEXT_BYTES >> 20} MiB",
                        "pass a smaller text file (the first part of it is enough)")
    return data


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> np.ndarray:
    """The text's token ids (int64, 1-D) without BOS/EOS, cut to the first `max_tokens`."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = np.asarray(ids, dtype=np.int64)
    return ids[:max_tokens] if max_tokens else ids
