"""ONNX Runtime custom ops of enginesmith (libenginesmith_ort_ops.so, built with the plugins by
plugins/CMakeLists.txt): the decode GEMVs of passes/ort_gemv.py, with CUDA and CPU kernels.

The library is found at $ENGINESMITH_ORT_OPS_LIB, else <build dir>/libenginesmith_ort_ops.so (the build
dir of plugins/kernels.py: $ENGINESMITH_PLUGINS_BUILD or plugins/build).
"""

from __future__ import annotations

import os
from pathlib import Path

from enginesmith.errors import UserError
from enginesmith.plugins.kernels import build_dir

DOMAIN = "com.enginesmith"
LIBRARY = "libenginesmith_ort_ops.so"


def library_path() -> Path:
    env = os.environ.get("ENGINESMITH_ORT_OPS_LIB")
    return Path(env) if env else build_dir() / LIBRARY


def available() -> bool:
    return library_path().is_file()


def require() -> Path:
    path = library_path()
    if not path.is_file():
        raise UserError(f"the enginesmith ONNX Runtime ops library is not built ({path} not found)",
                        "build it: cmake -S plugins -B plugins/build -DENGINESMITH_BUILD_TRT_PLUGINS=OFF && "
                        "cmake --build plugins/build --target enginesmith_ort_ops (or set ENGINESMITH_ORT_OPS_LIB)")
    return path


def register(opts, needed: bool = False) -> bool:
    """Register the library into ORT SessionOptions `opts` if it is built; with `needed`, a missing
    library is a UserError. Returns whether it was registered."""
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
