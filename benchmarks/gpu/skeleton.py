"""Carry a multi-GB graph to the GPU machine without its weights, and give it random ones there.

Speed does not depend on weight values, and one device call carries at most 64 MiB. So:

    strip(model.onnx, out.onnx)    here: the graph with its small tensors inlined (norms, rotary
                                   tables, int4 scales: under --inline bytes) and its big ones left as
                                   external-data references (name, offset, length) into out.onnx.data
    materialize(out.onnx)          there: writes out.onnx.data, each big tensor filled with random
                                   values of its type (fp16/fp32 ~ N(0, 0.02), bytes uniform), tiled
                                   from one random block so a 2.5 GB file takes seconds

    python benchmarks/gpu/skeleton.py strip SRC.onnx DST.onnx
    python benchmarks/gpu/skeleton.py materialize DST.onnx
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

INLINE_BYTES = 4 << 20


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def strip(src: Path, dst: Path, inline_bytes: int = INLINE_BYTES) -> dict:
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(src), load_external_data=False)
    data_src = src.with_name(_data_name(model, src))
    data_dst = dst.name + ".data"
    offset, stats = 0, {"inlined": 0, "external": 0, "external_bytes": 0}
    with open(data_src, "rb") as f:
        for tensor in model.graph.initializer:
            if not uses_external_data(tensor):
                continue
            info = _external(tensor)
            length = int(info.get("length", 0))
            if length <= inline_bytes:
                f.seek(int(info.get("offset", 0)))
                tensor.raw_data = f.read(length)
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
                stats["inlined"] += 1
                continue
            offset = -(-offset // 4096) * 4096
            del tensor.external_data[:]
            for key, value in (("location", data_dst), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += length
            stats["external"] += 1
            stats["external_bytes"] += length
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return stats


def _data_name(model, src: Path) -> str:
    from onnx.external_data_helper import uses_external_data

    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            return _external(tensor)["location"]
    return src.name + ".data"


def materialize(path: Path, seed: int = 0) -> int:
    """Write `path`.data with random contents for every external tensor; returns its size."""
    import onnx
    from onnx import helper
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(seed)
    block = 16 << 20
    blocks = {
        "float": (rng.standard_normal(block // 2) * 0.02).astype(np.float16).tobytes(),
        "bytes": rng.integers(0, 256, block, dtype=np.uint8).tobytes(),
    }
    f32 = (rng.standard_normal(block // 4) * 0.02).astype(np.float32).tobytes()
    size = 0
    target = None
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor):
            continue
        info = _external(tensor)
        target = path.with_name(info["location"])
        size = max(size, int(info["offset"]) + int(info["length"]))
    if target is None:
        return 0
    with open(target, "wb") as f:
        f.truncate(size)
        for tensor in model.graph.initializer:
            if not uses_external_data(tensor):
                continue
            info = _external(tensor)
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            fill = f32 if dtype == np.float32 else blocks["float"] if dtype in (np.float16,) else blocks["bytes"]
            f.seek(int(info["offset"]))
            left = int(info["length"])
            while left > 0:
                chunk = fill[: min(left, len(fill))]
                f.write(chunk)
                left -= len(chunk)
    return os.path.getsize(target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("strip")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    s.add_argument("--inline", type=int, default=INLINE_BYTES)
    m = sub.add_parser("materialize")
    m.add_argument("path", type=Path)
    args = ap.parse_args(argv)
    if args.verb == "strip":
        print(strip(args.src, args.dst, args.inline))
    else:
        print(materialize(args.path), "bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
