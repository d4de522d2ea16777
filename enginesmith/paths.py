"""Where enginesmith keeps its caches (engines built on first use, corpus token caches)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$ENGINESMITH_CACHE, else $XDG_CACHE_HOME/enginesmith, else ~/.cache/enginesmith."""
    env = os.environ.get("ENGINESMITH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "enginesmith"
