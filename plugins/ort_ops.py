"""ONNX Runtime custom ops of enginesmith (libenginesmith_ort_ops.so, built with the plugins by
plugins/CMakeLists.txt): the decode GEMVs of passes/lower/ort_gemv.py, with CUDA and CPU kernels.

The library is found as plugins/compile.py says: $ENGINESMITH_ORT_OPS_LIB, else
$ENGINESMITH_PLUGINS_BUILD/libenginesmith_ort_ops.so, else plugins/build/ of a source checkout, else
the cache entry for this machine's GPU, which `require()` compiles on first use.
"""

from __future__ import annotations

from pathlib import Path

from enginesmith.core.io_names import ORT_OPS_DOMAIN as DOMAIN
from enginesmith.plugins import compile as plugin_compile

LIBRARY = plugin_compile.LIBRARIES["ort_ops"]


def library_path() -> Path | None:
    """Where the library is, or would be compiled to on this machine; None on a machine without a
    GPU, a variable or a compiled cache entry (plugins/compile.py: locate)."""
    where = plugin_compile.locate("ort_ops", any_arch=True)
    return where.path if where else None


def available() -> bool:
    """Whether the library is built for this machine already (nothing is compiled to answer). A cache
    entry counts only when it was compiled for this machine's GPU."""
    where = plugin_compile.locate("ort_ops")
    return where is not None and where.built


def require() -> Path:
    """The library's path, compiled on first use (for this machine's GPU); a UserError that says how
    to build it when that cannot happen here."""
    return plugin_compile.ensure("ort_ops")


def register(opts, needed: bool = False) -> bool:
    """Register the library into ORT SessionOptions `opts` if it is built; with `needed`, it is
    compiled first if missing (or a UserError says why it cannot be). Returns whether it was registered."""
    if not needed and not available():
        return False
    opts.register_custom_ops_library(str(require()))
    return True


def graph_uses_ops(onnx_path: str | Path) -> bool:
    """Whether the model imports the com.enginesmith domain (reads the graph, not its weights)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return any(o.domain == DOMAIN for o in model.opset_import)


def register_for(opts, onnx_path: str | Path) -> bool:
    """Register the library if the model at `onnx_path` needs it (a UserError if it is not built)."""
    return register(opts, needed=True) if graph_uses_ops(onnx_path) else False
