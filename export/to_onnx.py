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

import onnx_ir as ir
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
    wrapper = KVCacheIO(_rope_tables_fp32(model.to(tdtype))).eval()
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
            cast_rms_inputs(program.model.graph)
            program.save(str(out_path), external_data=True)
    except torch.onnx.OnnxExporterError as exc:  # torch.export or the ONNX translation failed on this model
        first = next((line for line in str(exc).splitlines() if "Exception summary" not in line and line.strip()), "")
        cause = getattr(exc, "__cause__", None)
        raise UserError(f"torch.onnx could not export {type(model).__name__} in {dtype}: "
                        f"{(str(cause).splitlines() or [''])[0] if cause else first}"[:400],
                        "try another --dtype (fp32 exports are tested for every family), or report it "
                        "with ENGINESMITH_DEBUG=1's traceback") from exc
    finally:
        model.to(torch.float32)
    data = out_path.with_name(out_path.name + ".data")
    if not data.exists():  # tiny models can end up without external data; keep the layout fixed
        data.write_bytes(b"")
    return out_path


def _rope_tables_fp32(model):
    """RoPE frequency buffers back to fp32 after the model's cast: transformers computes the tables in fp32
    from them, and LongRoPE (Phi-3) selects between its fp32 long factors and the cast original ones, which
    torch.export refuses when they differ in type."""
    for module in model.modules():
        for name in ("inv_freq", "original_inv_freq", "long_inv_freq"):
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
                setattr(module, name, value.float())
    return model


def cast_rms_inputs(graph: ir.Graph) -> int:
    """RMSNormalization whose input X and scale differ in type (an fp16 model that normalizes in fp32:
    OLMo 2, Gemma) gets X cast to the scale's type. The operator's spec gives Y the scale's type, as the
    exporter declares it; ONNX Runtime 1.31 and onnx 1.23's type inference give it X's, and refuse the
    graph. After the Cast both read it alike (the norm's arithmetic is fp32 either way). Returns the count."""
    count = 0
    for node in list(graph):
        if node.op_type != "RMSNormalization" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        x, scale = node.inputs[0], node.inputs[1]
        if x is None or scale is None or x.dtype is None or scale.dtype is None or x.dtype == scale.dtype:
            continue
        cast = ir.Node("", "Cast", [x], [ir.AttrInt64("to", int(scale.dtype))], num_outputs=1,
                       name=f"{node.name or 'rms'}_input_cast")
        cast.outputs[0].name = f"{x.name}_as_{scale.dtype.name.lower()}_{count}"
        cast.outputs[0].type, cast.outputs[0].shape = ir.TensorType(scale.dtype), x.shape
        graph.insert_before(node, cast)
        node.replace_input_with(0, cast.outputs[0])
        count += 1
    return count


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
