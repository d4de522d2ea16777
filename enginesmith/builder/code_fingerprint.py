"""The fingerprint of the code that writes engines: a cached engine built by other code is rebuilt.

The engine cache is keyed by the build's settings and the source model's hash (`BuildConfig.key`), so an
upgrade of enginesmith that changes what the export or a pass writes would otherwise keep handing out
engines of the old code. build.json records this fingerprint (`builder_code`); `cached_engine` rebuilds an
entry whose fingerprint differs. Engines opened by path (`--engine DIR`) are not affected: they are the
user's, and build.json's format version alone decides whether they open.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

# The packages whose code decides an engine's files: the builder, the export, the model loaders (tiny
# configs included) and the graph passes. The runtime and the servers read engines; they are not here.
PACKAGES = ("enginesmith.builder", "enginesmith.core", "enginesmith.export", "enginesmith.models",
            "enginesmith.passes")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 (first 16 hex digits) over the path and bytes of every .py file of PACKAGES."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            root = Path(location)
            for path in sorted(root.rglob("*.py")):
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
