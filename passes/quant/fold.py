"""Fold a per-channel scale into a site: the producer absorbs 1/s, the consumers' weight rows absorb s.

    before:  X ─ consumers(W)            after:  X/s ─ consumers(diag(s) W)     (X/s)(sW) = XW

Shared by SmoothQuant (s from activation and weight ranges) and AWQ (s searched per site). Exact
up to fp32 rounding; the pass manager checks that on sample inputs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from enginesmith.passes.machinery.edit import Namer, set_constant
from enginesmith.passes.analysis.sites import Site


def _along(s: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return s.reshape(shape)


def fold_scales(graph: ir.Graph, namer: Namer, site: Site, s: np.ndarray) -> None:
    """Divide the site's producer constants by `s` (site channels) and multiply the consumers'
    weight rows by `s` expanded to their K channels."""
    s = np.asarray(s, dtype=np.float64)
    if s.shape != (site.channels,) or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"scales for {site.name} must be {site.channels} positive finite numbers")
    for node, index, axis in site.divide:
        value = node.inputs[index]
        array = value.const_value.numpy().astype(np.float64)
        set_constant(graph, namer, node, value, array / _along(s, array.ndim, axis))
    s_k = site.consumer_scale(s)
    for lin in site.consumers:
        value = lin.weight
        array = value.const_value.numpy().astype(np.float64)
        set_constant(graph, namer, lin.reader, value, array * _along(s_k, 2, lin.k_axis))


def weight_row_absmax(site: Site) -> np.ndarray:
    """max |W[k, :]| over all consumers, per consumer channel k (a [K] array)."""
    out = None
    for lin in site.consumers:
        w = np.abs(lin.weight_kn()).max(axis=1)
        out = w if out is None else np.maximum(out, w)
    return out
