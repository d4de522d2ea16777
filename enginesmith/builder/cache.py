"""The engine cache: engines built on first use under <cache>/engines/<key>, and the plain engines a
pass build starts from.

    key = <source sha256[:16]>-<sha256(settings that change the engine + version)[:12]>
    (build.config.cache_key: only what a step of the build reads)

A cached engine is used as it is found only when its build.json names this builder code; `source`
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


def cached_engine(config: BuildConfig, progress: bool = True, verify_hashes: bool = False) -> Path:
    """The engine for `config` from the cache, building it first if it is not there yet. With
    `verify_hashes` (a source whose bytes go into another engine) every file's sha256 is checked too."""
    from enginesmith.builder.engine import build  # deferred: engine.py imports this module

    path = default_engine_path(config)
    if _usable(path, notice=False, hashes=verify_hashes):
        return path
    with engine_dir.lock(path, wait=True):  # another process building the same engine: wait for it
        if _usable(path, notice=True, hashes=verify_hashes):
            return path
        print(f"Building the engine for {config.model or 'the default model (SmolLM2-135M-Instruct)'} "
              f"once; it is cached in {path}")
        build(config, path, force=True, progress=progress, locked=True, replace_any=True)
    return path


def source(config: BuildConfig, progress: bool = True) -> Path:
    """The cached engine a pass build or a CUDA lowering reads its graph from, its hashes verified."""
    return cached_engine(config, progress=progress, verify_hashes=True)


def _usable(path: Path, notice: bool, hashes: bool) -> bool:
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
