"""When does the 2:4 sparse GEMM beat the dense one? A per-shape rule measured on a GPU.

The table (JSON, written by benchmarks/plugins/bench_plugins.py) holds, for each measured weight
shape (K = in_features, N = out_features), the speedup of SparseGemm24 over dense torch.matmul at
each M (rows of X = tokens per call), and `min_m`: the smallest measured M from which sparse is at
least `threshold` times faster at that M and every larger one (null: never). The sparsify pass asks
`sparse_is_profitable(k, n, m)` per layer and keeps the layer dense when it says no.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_TABLE = Path(__file__).resolve().parent / "sparse_gemm" / "profitability.json"
THRESHOLD = 1.05  # sparse must win by 5 % to be worth a second code path


def table_from_benchmark(rows: list[dict], device: str, threshold: float = THRESHOLD) -> dict:
    """Build the table from bench_plugins.py's sparse rows (K, N, M, speedup_vs_dense and, from a
    --tune run, speedup_tuned_vs_dense: the best kernel configuration, which the TensorRT plugin
    offers as a tactic; the better of the two counts)."""
    shapes: dict[str, dict[int, float]] = {}
    for r in rows:
        best = max(float(r["speedup_vs_dense"]), float(r.get("speedup_tuned_vs_dense") or 0.0))
        shapes.setdefault(f"{r['K']}x{r['N']}", {})[int(r["M"])] = best
    out = {"device": device, "threshold": threshold, "shapes": {},
           "metric": "dense_ms / sparse_ms (fp16), sparse at cuSPARSELt's default or, where timed, best configuration"}
    for key, by_m in shapes.items():
        ms = sorted(by_m)
        min_m = None
        for i, m in enumerate(ms):
            if all(by_m[x] >= threshold for x in ms[i:]):
                min_m = m
                break
        out["shapes"][key] = {"speedup_by_m": {str(m): by_m[m] for m in ms}, "min_m": min_m}
    return out


def load_table(path: Path | str | None = None) -> dict:
    return json.loads(Path(path or DEFAULT_TABLE).read_text())


def sparse_is_profitable(k: int, n: int, m: int, table: dict | None = None) -> bool:
    """True when the nearest measured shape (log-distance in K and N) wins from this M on. A product
    with under a quarter of the smallest measured K·N is never called profitable: the table says
    nothing about it, and 2:4 sparsity only loses more as products shrink."""
    table = table or load_table()
    sizes = [int(a) * int(b) for a, b in (key.split("x") for key in table["shapes"])]
    if not sizes or k * n * 4 < min(sizes):
        return False
    best, best_d = None, math.inf
    for key, entry in table["shapes"].items():
        tk, tn = (int(v) for v in key.split("x"))
        d = abs(math.log2(tk / k)) + abs(math.log2(tn / n))
        if d < best_d:
            best, best_d = entry, d
    if best is None or best["min_m"] is None:
        return False
    return m >= best["min_m"]
