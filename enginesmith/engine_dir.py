"""The engine directory: what a build writes and the only thing the runtime loads.

    <engine>/model.onnx, model.onnx.data      the final graph
    <engine>/tokenizer/...                    tokenizer files (and chat template)
    <engine>/build.json                       source, passes, precision, KV layout, backend,
                                              and sha256 of every other file

`write_atomically` builds into a temp directory beside the target and renames it into place, so
an interrupted build never leaves a half-written engine. `verify` refuses a directory whose files
are missing or altered, or that was built for another backend/version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from enginesmith.errors import EngineError

FORMAT_VERSION = 1
MANIFEST = "build.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root except build.json, keyed by relative posix path."""
    return {
        p.relative_to(root).as_posix(): sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


@contextlib.contextmanager
def write_atomically(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `target`, on any failure it is removed."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise EngineError(f"{target} already exists", "pass --force to replace it or choose another --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:  # KeyboardInterrupt included: leave nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(root: Path, manifest: dict) -> dict:
    manifest = dict(manifest, format_version=FORMAT_VERSION, files=file_hashes(root))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(root: Path) -> dict:
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise EngineError(f"engine directory {root} does not exist", "run `enginesmith build` to create it")
    if not path.is_file():
        raise EngineError(f"{root} has no {MANIFEST}: not an engine directory or an incomplete build",
                          "rebuild it with `enginesmith build`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON ({exc.msg})", "rebuild the engine") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EngineError(f"{root} has engine format {manifest.get('format_version')}, this enginesmith "
                          f"reads {FORMAT_VERSION}", "rebuild the engine with this version")
    return manifest


def verify(root: Path, backend_check: Callable[[dict], None] | None = None, hashes: bool = True) -> dict:
    """Read build.json and check every file against it; return the manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    expected: dict[str, str] = manifest.get("files", {})
    for rel, digest in expected.items():
        path = root / rel
        if not path.is_file():
            raise EngineError(f"engine file {rel} is missing from {root}", "rebuild the engine")
        if hashes and sha256(path) != digest:
            raise EngineError(f"engine file {rel} in {root} was altered (sha256 mismatch)", "rebuild the engine")
    extra = set(file_hashes(root) if hashes else {}) - set(expected)
    if extra:
        raise EngineError(f"{root} holds files build.json does not list: {', '.join(sorted(extra))}",
                          "remove them or rebuild the engine")
    if backend_check:
        backend_check(manifest)
    return manifest
