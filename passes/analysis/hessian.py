"""Calibration Hessians: H = X^T X / n of a linear's input X [n, K], over every calibration token.

GPTQ minimizes || X W - X Q ||² = tr((W - Q)^T H (W - Q)) per linear, so it needs the full Gram
matrix of each input tensor, not the sampled rows `calibrate` keeps. A graph's inputs are collected
in chunks whose float64 accumulators fit `budget_bytes` (one ORT pass over the calibration set per
chunk), so a large model never holds all its Hessians at once:

    names ─ chunk (Σ K² · 8 bytes <= budget) ─ ORT over N windows ─ Σ x^T x / n ─ cache/<key>/<name>.npy

Cached as float32 per tensor under cache_dir()/calib/<graph hash>-<calibration key>-hessian/, the
same key as the activation statistics (graph content, calibration set).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from enginesmith.passes.analysis.calibrate import CalibrationSet, graph_hash, open_session, run_windows
from enginesmith.core.paths import cache_dir

DEFAULT_BUDGET = 512 << 20


def _file(folder: Path, name: str) -> Path:
    return folder / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".npy")


def chunks(names: list[str], widths: dict[str, int], budget_bytes: int) -> list[list[str]]:
    """`names` split in order into groups whose float64 K x K accumulators fit the budget
    (a single tensor larger than the budget gets a group of its own)."""
    groups, size = [[]], 0
    for name in names:
        need = widths[name] ** 2 * 8
        if groups[-1] and size + need > budget_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += need
    return [g for g in groups if g]


def collect(onnx_path: str | os.PathLike, names: list[str], widths: dict[str, int], calib: CalibrationSet,
            budget_bytes: int = DEFAULT_BUDGET, progress: bool = True):
    """Yield (name, H [K, K] float64) for every tensor of `names` (K = widths[name]), computed or
    read from the cache; at most one chunk's Hessians are in memory at a time."""
    onnx_path = Path(onnx_path)
    folder = cache_dir() / "calib" / f"{graph_hash(onnx_path)}-{calib.key}-n{calib.samples}-hessian"
    todo = [n for n in names if not _file(folder, n).is_file()]
    for group in chunks(todo, widths, budget_bytes):
        session = open_session(onnx_path, group)
        acc = {n: np.zeros((widths[n], widths[n])) for n in group}
        rows = 0
        for outs in run_windows(session, group, calib, progress, desc="hessians"):
            for name, x in zip(group, outs):
                x = x.reshape(-1, x.shape[-1]).astype(np.float32, copy=False)
                acc[name] += (x.T @ x).astype(np.float64)
            rows += outs[0].reshape(-1, outs[0].shape[-1]).shape[0]
        del session
        folder.mkdir(parents=True, exist_ok=True)
        for name in group:
            _save(_file(folder, name), (acc.pop(name) / rows).astype(np.float32))
    for name in names:
        yield name, np.load(_file(folder, name)).astype(np.float64)


def _save(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=path.parent)
    os.close(fd)
    try:
        np.save(tmp, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
