"""What an attacker who can write an engine directory does after editing it: recompute build.json's
file records so that sizes and hashes match again (the loader must then refuse on other grounds)."""

from __future__ import annotations

import json
from pathlib import Path

from enginesmith.core import engine_dir


def file_records(path: Path) -> dict:
    """{relative path: {sha256, size}} of every regular file under `path` except build.json."""
    return {p.relative_to(path).as_posix(): {"sha256": engine_dir.sha256(p), "size": p.stat().st_size}
            for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != "build.json"}


def resign(path: Path, manifest: dict | None = None) -> None:
    """Write build.json as `manifest` (default: the one there, if it is a JSON object) with fresh
    file records; a build.json that is not a JSON object is left as it is."""
    if manifest is None:
        try:
            manifest = json.loads((path / "build.json").read_text())
        except (ValueError, OSError):
            return
        if not isinstance(manifest, dict):
            return
    (path / "build.json").write_text(json.dumps(dict(manifest, files=file_records(path))))
