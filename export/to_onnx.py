"""Export a causal LM with KV-cache inputs/outputs to ONNX (torch.onnx, dynamo exporter).

Dynamic axes: batch, sequence, past length and the attention mask's total length (torch.export
cannot express `past + seq` as a spec, so the mask has its own dim). Weights go to external data
(`<name>.onnx.data`). Precision is chosen here by casting the PyTorch model before tracing, so it
is a property of the graph (TensorRT 11 networks are strongly typed).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch

from enginesmith.core.errors import UserError
from enginesmith.core.io_names import input_names, output_names
from enginesmith.export import attention_meta
from enginesmith.export.kv_io import KVCacheIO, KVShape

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_OPSET = 24  # Attention attributes of opset 25+ are rejected by ORT 1.31


def example_inputs(shape: KVShape, dtype: torch.dtype, batch: int = 2, seq: int = 3, past: int = 5):
    ids = torch.randint(0, shape.vocab, (batch, seq), dtype=torch.int64)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq, dtype=torch.int64).expand(batch, seq).contiguous()
    kv = []
    for _ in range(shape.layers):
        for _ in range(2):
            kv.append(torch.randn(batch, shape.kv_heads, past, shape.head_dim, dtype=dtype))
    return (ids, mask, pos, *kv)


def dynamic_shapes(layers: int):
    b = torch.export.Dim("batch", min=1, max=1024)
    s = torch.export.Dim("sequence", min=1, max=1 << 20)
    p = torch.export.Dim("past_sequence", min=0, max=1 << 20)
    t = torch.export.Dim("total_sequence", min=1, max=1 << 21)
    kv = [{0: b, 2: p} for _ in range(2 * layers)]
    return ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, tuple(kv))  # *past is one varargs tuple


def export(model, out_path: Path, dtype: str = "fp32", opset: int = 23, verbose: bool = False) -> Path:
    """Write `out_path` (+ `.data`) and return it. `model` is left in fp32."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if not 17 <= opset <= MAX_OPSET:
        raise UserError(f"opset {opset} is out of range", f"use an opset from 17 to {MAX_OPSET}")
    shape = KVShape.of(model.config)
    tdtype = DTYPES[dtype]
    wrapper = KVCacheIO(model.to(tdtype)).eval()
    args = example_inputs(shape, tdtype)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    quiet = contextlib.nullcontext() if verbose else _silenced()
    try:
        with quiet, torch.no_grad(), _state_kept(model):
            program = torch.onnx.export(
                wrapper, args, dynamo=True, opset_version=opset, optimize=True,
                input_names=input_names(shape.layers), output_names=output_names(shape.layers),
                dynamic_shapes=dynamic_shapes(shape.layers), external_data=True,
            )
            program.model.metadata_props[attention_meta.METADATA_KEY] = attention_meta.dumps(
                attention_meta.of_config(model.config))
            program.save(str(out_path), external_data=True)
    finally:
        model.to(torch.float32)
    data = out_path.with_name(out_path.name + ".data")
    if not data.exists():  # tiny models can end up without external data; keep the layout fixed
        data.write_bytes(b"")
    return out_path


@contextlib.contextmanager
def _state_kept(model):
    """Tracing runs forward() on fake tensors; a module that caches a tensor as a plain attribute on
    first use (Phi-3's LongRoPE `long_inv_freq`) would keep a traced one and give wrong eager
    results afterwards. Put back the plain tensor attributes as they were (drop the new ones)."""
    before = {id(m): {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)} for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            kept = before.get(id(m), {})
            for key in [k for k, v in vars(m).items() if isinstance(v, torch.Tensor)]:
                if key in kept:
                    setattr(m, key, kept[key])
                else:
                    delattr(m, key)


@contextlib.contextmanager
def _silenced():
    """The exporter prints a page of progress and warnings per call; keep them out of the CLI."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)
