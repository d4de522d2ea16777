"""The engine cache's store: where an engine of a BuildConfig lives (<cache>/engines/<key>) and whether
the one found there may be used. Building a missing one is the builder's (engine.cached_engine); this
module builds nothing, so engine.py imports it and never the reverse.

    key = <source sha256[:16]>-<sha256(settings that change the engine + version)[:12]>
    (builder/config.py, BuildConfig.key: only what a step of the build reads)

A cached engine is used as it is found only when its build.json names this builder code; a source
(the plain engine under a pass build, or the one a CUDA lowering starts from) also checks every
recorded sha256 first, since its bytes go into a new engine that is hashed afresh: a corrupted entry
is rebuilt with a one-line notice, never passed on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from enginesmith.builder.code_fingerprint import code_fingerprint
from enginesmith.builder.config import BuildConfig
from enginesmith.core import engine_dir
from enginesmith.core.errors import UserError
from enginesmith.core.paths import cache_dir
from enginesmith.models import load as models


def default_engine_path(config: BuildConfig) -> Path:
    source = models.resolve(config.model)
    return cache_dir() / "engines" / config.key(source.sha256)


def usable(path: Path, notice: bool, hashes: bool) -> bool:
    """Whether the cached engine at `path` has a build.json this enginesmith reads, written by this
    code (code_fingerprint), and with `hashes`, files of their recorded sizes and sha256; a stale or
    broken one is rebuilt (with a notice) by the caller. Without `hashes`, its files are verified when
    it is opened."""
    if not os.path.lexists(path):
        return False
    try:
        manifest = engine_dir.verify(path) if hashes else engine_dir.read_manifest(path)
    except UserError as exc:
        if notice:
            print(f"notice: the cached engine {path} is unusable ({exc.what}); rebuilding it", file=sys.stderr)
        return False
    if manifest.raw.get("builder_code") != code_fingerprint():
        if notice:
            print(f"notice: the cached engine {path} was built by other enginesmith code; rebuilding it",
                  file=sys.stderr)
        return False
    return True
