"""Which ONNX Runtime is installed: the one check the runtime makes before it imports it.

ONNX Runtime ships as several PyPI distributions that all provide the same `onnxruntime` module:
`onnxruntime` (CPU) and `onnxruntime-gpu` (CUDA, with the CPU provider too). enginesmith depends on
neither directly; its extras pick one: `enginesmith[cpu]` or `enginesmith[cuda]`.

Two of them installed into the same site-packages overwrite each other's files: the module is a mix
of whichever wrote last (a CPU build under a GPU version number, a CUDA provider without its
libraries), so `check()` refuses that with the fix. The same distributions in *different* sys.path
entries are fine: Python imports the first entry's module, the other is shadowed (the GPU machine
has a CPU onnxruntime in its system site-packages and onnxruntime-gpu in a --target folder in front).
Only metadata and the import system's finder are read here, so this module imports without ONNX
Runtime (doctor uses it to say what is missing).

The runtime imports ONNX Runtime as `from enginesmith.core.onnxruntime_flavour import onnxruntime as ort`:
the same module object, fetched through require() (the module __getattr__ below), so the check runs
before the first `import onnxruntime` of any code path.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginesmith.core.errors import UserError

# PyPI distributions that install the `onnxruntime` module, and the flavour each one is.
FLAVOURS = {
    "onnxruntime": "cpu",
    "onnxruntime-gpu": "cuda",
    "onnxruntime-directml": "directml",
    "onnxruntime-openvino": "openvino",
    "onnxruntime-qnn": "qnn",
    "onnxruntime-training": "training",
    "ort-nightly": "cpu",
    "ort-nightly-gpu": "cuda",
}
INSTALL_FIX = 'pip install "enginesmith[cpu]" or "enginesmith[cuda]"'
MIXED_FIX = 'pip uninstall -y onnxruntime onnxruntime-gpu && pip install "enginesmith[cuda]"'


@dataclass(frozen=True)
class Dist:
    name: str       # normalized distribution name, e.g. "onnxruntime-gpu"
    version: str
    location: Path  # the sys.path entry (site-packages) it is installed in

    @property
    def flavour(self) -> str:
        return FLAVOURS[self.name]


@dataclass(frozen=True)
class OrtInstall:
    """What `import onnxruntime` would load, without loading it."""

    module_dir: Path | None                 # the sys.path entry whose onnxruntime/ is imported; None: none
    active: tuple[Dist, ...] = ()           # distributions installed in module_dir (one when healthy)
    shadowed: tuple[Dist, ...] = ()         # installed in other sys.path entries: not imported
    problem: tuple[str, str] | None = None  # (what, fix) when the runtime must refuse
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def flavour(self) -> str | None:
        """cpu, cuda, ... ; "unknown" for a module without distribution metadata; None if absent."""
        if self.module_dir is None:
            return None
        return self.active[0].flavour if len(self.active) == 1 else "unknown"

    @property
    def version(self) -> str | None:
        return self.active[0].version if len(self.active) == 1 else None

    @property
    def distribution(self) -> str | None:
        return self.active[0].name if len(self.active) == 1 else None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> list[Dist]:
    """Every ONNX Runtime distribution on sys.path (looked up by name: no scan of all packages)."""
    found: dict[tuple[str, Path], Dist] = {}
    for name in FLAVOURS:
        for dist in importlib.metadata.distributions(name=name):
            meta_name = _normalize(dist.metadata["Name"] or name)
            if meta_name not in FLAVOURS:
                continue
            location = Path(str(dist.locate_file(""))).resolve()
            found.setdefault((meta_name, location), Dist(meta_name, dist.version, location))
    return list(found.values())


def _module_dir() -> Path | None:
    """The sys.path entry `import onnxruntime` resolves to (the finder runs; the package does not)."""
    try:
        spec = importlib.util.find_spec("onnxruntime")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.origin not in (None, "namespace") else None
    places = [Path(origin).parent] if origin else [Path(p) for p in (spec.submodule_search_locations or [])]
    return places[0].parent.resolve() if places else None


def inspect() -> OrtInstall:
    """The installed ONNX Runtime (flavour, version, conflicts); never imports it, never raises."""
    module_dir = _module_dir()
    dists = _installed()
    if module_dir is None:
        return OrtInstall(None, shadowed=tuple(dists),
                          problem=("ONNX Runtime is not installed", INSTALL_FIX))
    active = tuple(d for d in dists if d.location == module_dir)
    shadowed = tuple(d for d in dists if d.location != module_dir)
    notes = tuple(f"{d.name} {d.version} in {d.location} is shadowed by the one in {module_dir}" for d in shadowed)
    problem = None
    if len({d.name for d in active}) > 1:
        names = " and ".join(f"{d.name} {d.version}" for d in active)
        problem = (f"{names} are both installed in {module_dir}: they overwrite each other's onnxruntime "
                   "module", MIXED_FIX)
    return OrtInstall(module_dir, active, shadowed, problem, notes)


def check() -> OrtInstall:
    """The installed ONNX Runtime, or a UserError that says how to install it (missing) or repair it
    (two flavours mixed in one place)."""
    install = inspect()
    if install.problem:
        raise UserError(*install.problem)
    return install


def require() -> Any:
    """The `onnxruntime` module, after check(). The runtime imports ONNX Runtime through this, so a
    missing or mixed install is one line, not an ImportError traceback or a half-working session."""
    check()
    import onnxruntime  # deferred on purpose: this module must import without ONNX Runtime

    return onnxruntime


def __getattr__(name: str) -> Any:
    """`from enginesmith.core.onnxruntime_flavour import onnxruntime`: the module, through require()."""
    if name == "onnxruntime":
        return require()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
