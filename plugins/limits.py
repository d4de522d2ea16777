"""The CUDA kernels' limits, defined once in limits.json beside this file.

CMakeLists.txt reads limits.json and compiles it into the kernels (the ES_PA_* and ES_SPARSE_*
definitions paged_attention.h and sparse_gemm.h build their constants from; the kernels' C API,
es_paged_attention_limits, reports what was compiled in). Python reads the same file here, so the
lowering passes know the limits on a machine where nothing is compiled. tests/passes/test_paged_limits.py
holds a built library's C API to this file.
"""

from __future__ import annotations

import json
from pathlib import Path

from enginesmith.core.errors import UserError

LIMITS_JSON = Path(__file__).resolve().parent / "limits.json"


def limits() -> dict:
    """limits.json as {kernel: {name: int | tuple[int, ...]}}, e.g. limits()["sparse_gemm"]["dim_align"]."""
    try:
        data = json.loads(LIMITS_JSON.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the CUDA kernels' limits ({LIMITS_JSON}): {exc}",
                        "reinstall enginesmith (limits.json ships with enginesmith.plugins)") from None
    return {kernel: {name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()}
            for kernel, fields in data.items()}
