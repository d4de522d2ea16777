"""Is TensorRT here: the checks (and the plugin loading) that the builder and the runtime share.

`tensorrt` and torch (for the GPU's compute capability) are imported only inside these functions
(deferred on purpose: both are heavy and optional); without TensorRT every entry point raises a
UserError that says how to get it. Callers then `import tensorrt as trt` locally, so mypy checks
every call against the stubs (tests/builder/test_trt_types.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from enginesmith.core.errors import UserError

if TYPE_CHECKING:
    import tensorrt as trt

FIX = ("install TensorRT 10.x/11.x for this GPU (pip install tensorrt-cu12 or the JetPack package), "
       "or use the ONNX Runtime backend (--backend ort)")


def ensure_tensorrt() -> None:
    """Raise a UserError saying how to get TensorRT when `import tensorrt` fails."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise UserError("TensorRT is not installed (import tensorrt failed)", FIX) from None


def require_tensorrt() -> str:
    """Check up front (before a long export) that TensorRT and a CUDA GPU are here; return the TRT version."""
    ensure_tensorrt()
    import tensorrt as trt

    version = str(trt.__version__)
    if current_sm() is None:
        raise UserError("TensorRT needs a CUDA GPU and none is visible", "run on a machine with an NVIDIA GPU")
    return version


def current_sm() -> str | None:
    """'major.minor' compute capability of CUDA device 0, or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


Shape = tuple[int, ...]


def shape_of(d: trt.Dims) -> Shape:
    """A TensorRT Dims as a tuple (-1 for dynamic dims)."""
    return tuple(int(d[i]) for i in range(len(d)))


def load_plugins(libraries: Sequence[str]) -> list[Any]:
    """Register the plugin creators of each library (getCreators) with TensorRT's registry."""
    import tensorrt as trt

    registry = trt.get_plugin_registry()
    handles = []
    for lib in libraries:
        if not Path(lib).is_file():
            raise UserError(f"plugin library {lib} does not exist",
                            "build it (cmake -S plugins -B plugins/build) or fix the path")
        handle = registry.load_library(str(lib))
        if handle is None:
            raise UserError(f"TensorRT could not load plugin library {lib}",
                            "check it was built for this TensorRT/CUDA (ldd, CMAKE_CUDA_ARCHITECTURES)")
        handles.append(handle)
    return handles
