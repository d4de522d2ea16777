"""com.enginesmith.GroupQueryAttention (plugins/ort_ops/attention.h) and the ort_attention pass.

CPU (here and in CI): the op's CPU kernel against ONNX Runtime's own com.microsoft.GroupQueryAttention
(the oracle: the op claims its semantics) on the same inputs, output and present KV, and against the
numpy reference (plugins/reference.py), plain and with softcap, local_window_size and head size 256;
bad inputs and attributes.
GPU (marked gpu): the CUDA kernel against the CPU kernel, decode (split keys, the last-block merge,
repeated calls) and prefill shapes, on ORT's stream and a user stream; the cache updated in place;
softcap, windows (long pasts: key tiles before the window skipped, splits over the window) and head
size 256 against the numpy reference.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

from plugin_modules import reference  # noqa: E402
from test_ort_ops import _session, gpu  # noqa: E402

INPUTS = ["qkv", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"]


def _model(ours: bool, h: int, hkv: int, d: int, scale: float, **options):
    """One GroupQueryAttention node; `options`: softcap, local_window_size (left out when not given)."""
    attrs = dict(num_heads=h, kv_num_heads=hkv, scale=scale, **options)
    if ours:
        node = helper.make_node("GroupQueryAttention", INPUTS, ["out", "present_key", "present_value"],
                                domain="com.enginesmith", **attrs)
    else:
        ins = [INPUTS[0], "", ""] + INPUTS[1:]
        node = helper.make_node("GroupQueryAttention", ins, ["out", "present_key", "present_value"],
                                domain="com.microsoft", do_rotary=1, rotary_interleaved=0, **attrs)
    f16 = T.FLOAT16
    inputs = [helper.make_tensor_value_info("qkv", f16, None), helper.make_tensor_value_info("past_key", f16, None),
              helper.make_tensor_value_info("past_value", f16, None),
              helper.make_tensor_value_info("seqlens_k", T.INT32, None),
              helper.make_tensor_value_info("total_sequence_length", T.INT32, []),
              helper.make_tensor_value_info("cos_cache", f16, None), helper.make_tensor_value_info("sin_cache", f16, None)]
    outputs = [helper.make_tensor_value_info(n, f16, None) for n in ("out", "present_key", "present_value")]
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.enginesmith", 1), helper.make_opsetid("com.microsoft", 1)])


def _feeds(rng, b, s, h, hkv, d, cap, pasts, positions=None):
    """Random qkv and caches; rows hold `pasts[i]` cached tokens (the rest of the buffer is noise that
    must stay unread); llama-style rotary tables over `positions` (default: the capacity)."""
    positions = positions or cap
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ang = np.arange(positions)[:, None] * inv[None, :]
    total = np.asarray(pasts) + s
    return {
        "qkv": rng.standard_normal((b, s, (h + 2 * hkv) * d)).astype(np.float16),
        "past_key": rng.standard_normal((b, hkv, cap, d)).astype(np.float16),
        "past_value": rng.standard_normal((b, hkv, cap, d)).astype(np.float16),
        "seqlens_k": (total - 1).astype(np.int32),
        "total_sequence_length": np.array(total.max(), dtype=np.int32),
        "cos_cache": np.cos(ang).astype(np.float16),
        "sin_cache": np.sin(ang).astype(np.float16),
    }


# (B, S, H, Hkv, D, capacity, pasts): decode, GQA groups of 1-8, both head sizes, prefill with and
# without a past, rows of different lengths.
CASES = [
    (2, 1, 8, 2, 64, 64, [5, 30]),
    (1, 1, 9, 3, 64, 48, [17]),       # SmolLM2's heads
    (1, 1, 32, 8, 64, 300, [257]),    # Llama-3.2-1B's
    (1, 5, 6, 2, 128, 32, [0]),       # a prompt
    (1, 3, 4, 4, 64, 40, [10]),
    (1, 4, 16, 2, 128, 64, [7]),
]


def _compare(got, want, totals):
    """Outputs close; the caches' first totals[b] positions of each row (ORT's CPU kernel leaves the
    rest of a separate present buffer zero) close for keys (rotated: rounding may differ) and equal
    for values."""
    out, w_out = got[0].astype(np.float32), want[0].astype(np.float32)
    assert np.isfinite(out).all()
    assert np.abs(out - w_out).max() <= 2e-3 * max(1.0, float(np.abs(w_out).max())), float(np.abs(out - w_out).max())
    for b, total in enumerate(totals):
        pk, w_pk = (a[b, :, :total].astype(np.float32) for a in (got[1], want[1]))
        assert np.abs(pk - w_pk).max() <= 2e-3 * float(np.abs(w_pk).max()), float(np.abs(pk - w_pk).max())
        assert np.array_equal(got[2][b, :, :total], want[2][b, :, :total])


@pytest.mark.parametrize("b,s,h,hkv,d,cap,pasts", CASES)
def test_cpu_kernel_matches_ort_group_query_attention(ops_lib, b, s, h, hkv, d, cap, pasts):
    rng = np.random.default_rng(b * 100 + s * 10 + h)
    feeds = _feeds(rng, b, s, h, hkv, d, cap, pasts)
    scale = 1.0 / np.sqrt(d)
    want = ort.InferenceSession(_model(False, h, hkv, d, scale).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    got = _session(_model(True, h, hkv, d, scale), ops_lib).run(None, feeds)
    _compare(got, want, feeds["seqlens_k"] + 1)
    # positions past the new tokens are untouched
    for i, past in enumerate(pasts):
        end = past + s
        assert np.array_equal(got[1][i, :, end:], feeds["past_key"][i, :, end:])
        assert np.array_equal(got[2][i, :, :past], feeds["past_value"][i, :, :past])


def test_rows_out_of_range_give_nan_not_numbers(ops_lib):
    rng = np.random.default_rng(3)
    feeds = _feeds(rng, 2, 1, 4, 2, 64, 16, [3, 3])
    feeds["seqlens_k"] = np.array([3, 40], dtype=np.int32)  # row 1: beyond the capacity
    out, pk, _ = _session(_model(True, 4, 2, 64, 0.125), ops_lib).run(None, feeds)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    assert np.array_equal(pk[1], feeds["past_key"][1])  # its cache untouched


@pytest.mark.parametrize("change,message", [
    (dict(d=96), "head size must be 64, 128 or 256"),
    (dict(total=99), "total_sequence_length must be in"),
    (dict(cos_rows=None), "cos_cache and sin_cache must be float16"),
])
def test_bad_inputs_are_named(ops_lib, change, message):
    d = change.get("d", 64)
    rng = np.random.default_rng(0)
    feeds = _feeds(rng, 1, 1, 4, 2, d, 16, [3])
    if "total" in change:
        feeds["total_sequence_length"] = np.array(change["total"], dtype=np.int32)
    if "cos_rows" in change:
        feeds["cos_cache"] = feeds["cos_cache"][:, :-1].copy()
    with pytest.raises(Exception, match=message):
        _session(_model(True, 4, 2, d, 0.125), ops_lib).run(None, feeds)


def test_heads_not_a_multiple_fail_at_session_creation(ops_lib):
    with pytest.raises(Exception, match="num_heads must be a positive multiple of kv_num_heads"):
        _session(_model(True, 6, 4, 64, 0.125), ops_lib)


def _pass_model(h=8, hkv=2, d=64, **attrs):
    """One com.microsoft.GroupQueryAttention as lower_gqa leaves it (rotary tables as constants), with
    `attrs` set on the node, as an onnx_ir model for the pass."""
    import onnx_ir as ir
    from onnx import numpy_helper

    proto = _model(False, h, hkv, d, 0.125)
    node = proto.graph.node[0]
    node.name = "gqa"
    kept = [a for a in node.attribute if a.name not in attrs]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value) for name, value in attrs.items()])
    table = np.zeros((32, d // 2), np.float16)  # the rotary tables as constants, as the exporter has them
    for name in ("cos_cache", "sin_cache"):
        proto.graph.input.remove(next(i for i in proto.graph.input if i.name == name))
        proto.graph.initializer.append(numpy_helper.from_array(table, name))
    for i in proto.graph.input:
        if i.name == "qkv":
            i.type.tensor_type.elem_type = T.FLOAT16
    return ir.from_proto(proto)


# ----------------------------------------------------------------------------- softcap, windows, D = 256
# (B, S, H, Hkv, D, capacity, pasts, softcap, local_window_size): decode and prompts (with and without
# a past), rows of different lengths, windows shorter and longer than the context, a window of one,
# Gemma's head size 256 alone and with both options. A softcap of 2 bends the tiny models' scores
# enough to show (Gemma 2's 50 barely would).
OPTION_CASES = [
    (2, 1, 8, 2, 64, 64, [5, 30], 2.0, -1),
    (2, 1, 8, 2, 64, 64, [5, 30], 0.0, 8),
    (1, 12, 4, 2, 64, 32, [0], 0.0, 4),
    (1, 5, 4, 2, 128, 48, [20], 2.0, 8),
    (1, 2, 4, 4, 64, 32, [3], 0.0, 100),
    (1, 4, 4, 2, 64, 16, [2], 0.0, 1),
    (1, 1, 8, 4, 256, 32, [10], 0.0, -1),
    (1, 6, 8, 4, 256, 32, [9], 2.0, 8),
    (1, 3, 8, 1, 256, 24, [12], 0.0, -1),
    (2, 1, 16, 2, 256, 24, [4, 12], 2.0, 8),
]


def _options(softcap, window):
    return {k: v for k, v in (("softcap", softcap), ("local_window_size", window)) if v not in (0.0, -1)}


def _reference(feeds, h, hkv, d, softcap=0.0, window=-1):
    return reference.group_query_attention(
        feeds["qkv"], feeds["past_key"], feeds["past_value"], feeds["seqlens_k"], feeds["cos_cache"],
        feeds["sin_cache"], h, hkv, 1.0 / np.sqrt(d), softcap=softcap, local_window_size=window)


@pytest.mark.parametrize("b,s,h,hkv,d,cap,pasts,softcap,window", OPTION_CASES)
def test_cpu_kernel_options_match_ort_and_numpy(ops_lib, b, s, h, hkv, d, cap, pasts, softcap, window):
    """softcap / local_window_size / head size 256: the CPU kernel against com.microsoft's (the oracle of
    the semantics, ORT 1.23+ windows) and against plugins/reference.py; each option changes the output."""
    rng = np.random.default_rng(b * 100 + s * 10 + d)
    feeds = _feeds(rng, b, s, h, hkv, d, cap, pasts)
    scale, options = 1.0 / np.sqrt(d), _options(softcap, window)
    want = ort.InferenceSession(_model(False, h, hkv, d, scale, **options).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    got = _session(_model(True, h, hkv, d, scale, **options), ops_lib).run(None, feeds)
    _compare(got, want, feeds["seqlens_k"] + 1)
    ref = _reference(feeds, h, hkv, d, softcap, window)
    _compare(got, ref, feeds["seqlens_k"] + 1)
    if options and not (window >= max(pasts) + s):  # the option bites: without it the output differs
        plain = _reference(feeds, h, hkv, d)[0].astype(np.float32)
        assert np.abs(plain - got[0].astype(np.float32)).max() > 1e-2


def test_numpy_reference_window_is_transformers_sliding_window():
    """reference.attention_mask: W keys, itself included (transformers' `q - k < sliding_window`)."""
    seen = reference.attention_mask(np.arange(6), np.arange(6), window=3)
    assert seen.sum(1).tolist() == [1, 2, 3, 3, 3, 3]
    assert seen[5].tolist() == [False, False, False, True, True, True]
    assert (reference.attention_mask(np.arange(6), np.arange(6)) == np.tril(np.ones((6, 6), bool))).all()


def test_keys_before_the_window_are_never_read(ops_lib):
    """Cache positions before a decode step's window hold NaN: the output stays finite and equal to the
    run on the clean cache (the kernel never reads them; CPU kernel here, CUDA below)."""
    rng = np.random.default_rng(4)
    h, hkv, d, cap, past, window = 8, 2, 64, 64, 40, 8
    feeds = _feeds(rng, 1, 1, h, hkv, d, cap, [past])
    model = _model(True, h, hkv, d, 0.125, local_window_size=window)
    want = _session(model, ops_lib).run(None, feeds)[0]
    for name in ("past_key", "past_value"):
        feeds[name][:, :, : past + 1 - window] = np.nan
    got = _session(model, ops_lib).run(None, feeds)[0]
    assert np.isfinite(got).all() and np.array_equal(got, want)


@pytest.mark.parametrize("attrs,message", [
    (dict(softcap=-1.0), "softcap must be >= 0"),
    (dict(local_window_size=0), "local_window_size must be positive, or -1"),
    (dict(local_window_size=-2), "local_window_size must be positive, or -1"),
])
def test_bad_options_fail_at_session_creation(ops_lib, attrs, message):
    with pytest.raises(Exception, match=message):
        _session(_model(True, 4, 2, 64, 0.125, **attrs), ops_lib)


def test_head_size_256_takes_at_most_8_query_heads_per_kv_head(ops_lib):
    feeds = _feeds(np.random.default_rng(0), 1, 1, 16, 1, 256, 16, [3])
    with pytest.raises(Exception, match="at most 8 query heads per KV head at head size 256"):
        _session(_model(True, 16, 1, 256, 0.0625), ops_lib).run(None, feeds)


# GPU: the CUDA kernel against the CPU kernel. Long pasts split the keys across blocks (merged by the
# last block); rows of one call have different lengths.
GPU_CASES = CASES + [
    (1, 1, 32, 8, 64, 4096, [3000]),
    (1, 1, 32, 8, 128, 8192, [8000]),
    (3, 1, 32, 8, 64, 2048, [1, 700, 2000]),
    (1, 1, 12, 12, 64, 1024, [1023 - 1]),
    (2, 9, 32, 8, 64, 1024, [100, 900]),     # speculative verification, rows of different lengths
    (2, 3, 4, 4, 64, 40, [2, 10]),
    (1, 130, 32, 8, 64, 256, [0]),           # a prompt over several tiles
    (1, 1, 9, 3, 64, 2048, [700]),           # SmolLM2's heads: decode, verification, a prompt
    (1, 9, 9, 3, 64, 1024, [300]),
    (1, 37, 9, 3, 64, 2048, [0]),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,hkv,d,cap,pasts", GPU_CASES)
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_kernel_matches_cpu_kernel(ops_lib, b, s, h, hkv, d, cap, pasts, stream):
    rng = np.random.default_rng(b * 1000 + s * 10 + d)
    feeds = _feeds(rng, b, s, h, hkv, d, cap, pasts)
    model = _model(True, h, hkv, d, 1.0 / np.sqrt(d))
    want = _session(model, ops_lib).run(None, feeds)
    cuda = _session(model, ops_lib, cuda=stream)
    for _ in range(3):  # the split counters must come back to zero after every call
        got = cuda.run(None, feeds)
        _compare(got, want, [cap] * b)


@gpu
@pytest.mark.gpu
def test_cuda_kernel_updates_a_shared_cache_in_place(ops_lib):
    """past and present bound to one device buffer (as GqaEngine binds them): the cache grows in place
    over decode steps, and each step's output matches the CPU kernel's."""
    import torch

    h, hkv, d, cap = 32, 8, 64, 1024
    rng = np.random.default_rng(5)
    model = _model(True, h, hkv, d, 0.125)
    cpu, cuda = _session(model, ops_lib), _session(model, ops_lib, cuda="ort")
    feeds = _feeds(rng, 1, 1, h, hkv, d, cap, [600])
    k_ref, v_ref = feeds["past_key"], feeds["past_value"]
    k_dev, v_dev = torch.from_numpy(k_ref.copy()).cuda(), torch.from_numpy(v_ref.copy()).cuda()
    for step in range(4):
        past = 600 + step
        feeds.update(qkv=rng.standard_normal((1, 1, (h + 2 * hkv) * d)).astype(np.float16),
                     seqlens_k=np.array([past], dtype=np.int32), total_sequence_length=np.array(past + 1, np.int32),
                     past_key=k_ref, past_value=v_ref)
        want, k_ref, v_ref = cpu.run(None, feeds)
        io = cuda.io_binding()
        io.bind_output("out", "cpu")  # the first output bound: copy_outputs_to_cpu()[0]
        for name in ("qkv", "seqlens_k", "cos_cache", "sin_cache"):
            io.bind_cpu_input(name, feeds[name])
        io.bind_cpu_input("total_sequence_length", feeds["total_sequence_length"])
        for name, t in (("past_key", k_dev), ("present_key", k_dev), ("past_value", v_dev), ("present_value", v_dev)):
            bind = io.bind_output if name.startswith("present") else io.bind_input
            bind(name, "cuda", 0, np.float16, list(t.shape), t.data_ptr())
        cuda.run_with_iobinding(io)
        got = io.copy_outputs_to_cpu()[0]
        assert np.abs(got.astype(np.float32) - want.astype(np.float32)).max() <= 2e-3 * max(1.0, float(np.abs(want).max()))
        assert np.abs(k_dev.cpu().numpy().astype(np.float32) - k_ref.astype(np.float32)).max() <= 2e-3 * 4
        assert np.array_equal(v_dev.cpu().numpy(), v_ref)


@gpu
@pytest.mark.gpu
def test_cuda_graph_of_one_shape_survives_a_workspace_grown_by_another(ops_lib):
    """ORT's CUDA graphs (one per shape, as the engines capture steps): a graph captured while the split
    workspace was small still replays correctly after a larger shape grew it."""
    import torch

    h, hkv, d, cap = 32, 2, 128, 8192  # 16 query heads per KV head: 16 rows, many splits
    model = _model(True, h, hkv, d, 1.0 / np.sqrt(d))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.register_custom_ops_library(str(ops_lib))
    ort.preload_dlls()
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    cpu = _session(model, ops_lib)
    rng = np.random.default_rng(9)
    keep = []

    def bound(b: int, past: int):
        feeds = _feeds(rng, b, 1, h, hkv, d, cap, [past] * b)
        feeds["total_sequence_length"] = np.array(cap, np.int32)  # as the engines bind it for graphs
        dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items() if k != "total_sequence_length"}
        out = torch.empty(b, 1, h * d, dtype=torch.float16, device="cuda")
        io = sess.io_binding()
        for name, t in dev.items():
            io.bind_input(name, "cuda", 0, np.int32 if t.dtype == torch.int32 else np.float16, list(t.shape), t.data_ptr())
        io.bind_cpu_input("total_sequence_length", feeds["total_sequence_length"])
        io.bind_output("out", "cuda", 0, np.float16, list(out.shape), out.data_ptr())
        for name, src in (("present_key", "past_key"), ("present_value", "past_value")):
            io.bind_output(name, "cuda", 0, np.float16, list(dev[src].shape), dev[src].data_ptr())
        keep.append((feeds, dev, out, io))
        return cpu.run(None, feeds)[0], out, io

    def run(io, graph_id: int, times: int = 3):
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        for _ in range(times):
            sess.run_with_iobinding(io, options)
        torch.cuda.synchronize()

    want_a, out_a, io_a = bound(1, 5000)
    run(io_a, 1)  # captured with the first (small) workspace
    want_b, out_b, io_b = bound(4, 5000)
    run(io_b, 2)  # 4x the splits' partials: the workspace grows
    got = out_b.cpu().numpy().astype(np.float32)
    assert np.abs(got - want_b.astype(np.float32)).max() <= 2e-3 * max(1.0, float(np.abs(want_b).max()))
    out_a.zero_()
    run(io_a, 1, times=2)  # replays of the first graph
    got = out_a.cpu().numpy().astype(np.float32)
    assert np.abs(got - want_a.astype(np.float32)).max() <= 2e-3 * max(1.0, float(np.abs(want_a).max()))


@pytest.mark.parametrize("change,reason", [
    (dict(do_rotary=0), "no fused rotary, or interleaved rotary (the kernel applies half-split rotary)"),
    (dict(smooth_softmax=1), "smooth_softmax=1 is not supported"),
    (dict(softcap=-1.0), "softcap=-1.0 is negative"),
    (dict(local_window_size=0), "local_window_size=0 is neither positive nor -1 (off)"),
    (dict(d=96), "head size 96 is not one of (64, 128, 256)"),
    (dict(h=34, hkv=2), "17 query heads per KV head, over 16 at head size 64"),
    (dict(h=16, hkv=1, d=256), "16 query heads per KV head, over 8 at head size 256"),
])
def test_pass_rejects_what_the_kernel_cannot_take_with_the_reason(change, reason):
    """A GroupQueryAttention the kernel does not implement stays com.microsoft's and is reported
    (node, reason); the pass only rewrites the graph here (no library needed)."""
    from enginesmith.passes.lower.ort_attention import ort_attention

    good = _pass_model()
    assert ort_attention(good).counts == {"attention": 1}
    assert {n.domain for n in good.graph} == {"com.enginesmith"}
    bad = _pass_model(**change)
    result = ort_attention(bad)
    assert result.counts == {"attention": 0}
    assert [(r.node, r.reason) for r in result.skipped] == [("gqa", reason)]
    assert [(n.domain, n.op_type) for n in bad.graph] == [("com.microsoft", "GroupQueryAttention")]


# GPU: softcap, windows and head size 256 against the numpy reference (and the CPU kernel). Long pasts
# with windows: the blocks start at their window (key tiles before it skipped) and split what is left.
GPU_OPTION_CASES = OPTION_CASES + [
    (1, 1, 32, 8, 64, 4096, [3000], 0.0, 512),
    (1, 1, 32, 8, 128, 8192, [8000], 50.0, 4096),
    (3, 1, 16, 8, 256, 2048, [1, 700, 2000], 50.0, 128),  # Gemma 2's heads, rows of different lengths
    (1, 1, 8, 4, 256, 4096, [4000], 0.0, -1),             # head size 256, split keys
    (1, 1, 8, 1, 256, 512, [300], 2.0, -1),               # 8 query heads per KV head (R = 8)
    (2, 9, 16, 8, 256, 1024, [100, 900], 50.0, 256),      # speculative verification
    (1, 130, 8, 4, 256, 256, [0], 50.0, 64),              # a prompt over several tiles
    (1, 37, 9, 3, 64, 2048, [1000], 0.0, 16),             # a prefill chunk after a past
    (1, 40, 32, 2, 64, 512, [0], 2.0, 8),                 # 16 query heads per KV head (R = 16)
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,hkv,d,cap,pasts,softcap,window", GPU_OPTION_CASES)
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_kernel_options_match_reference(ops_lib, b, s, h, hkv, d, cap, pasts, softcap, window, stream):
    rng = np.random.default_rng(b * 1000 + s * 10 + d)
    feeds = _feeds(rng, b, s, h, hkv, d, cap, pasts)
    model = _model(True, h, hkv, d, 1.0 / np.sqrt(d), **_options(softcap, window))
    want = _reference(feeds, h, hkv, d, softcap, window)
    _compare(_session(model, ops_lib).run(None, feeds), want, [cap] * b)
    cuda = _session(model, ops_lib, cuda=stream)
    for _ in range(3):  # the split counters must come back to zero after every call
        _compare(cuda.run(None, feeds), want, [cap] * b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("s,past,d", [(1, 3000, 64), (1, 700, 256), (9, 900, 128), (33, 500, 256)])
def test_cuda_kernel_never_reads_keys_before_the_window(ops_lib, s, past, d):
    """NaN in every cache position before the first new token's window: the CUDA output stays finite and
    equal to the run on the clean cache (those key tiles are skipped, not masked)."""
    h, hkv, cap, window = 8, 4, 4096, 64
    rng = np.random.default_rng(s + past)
    feeds = _feeds(rng, 1, s, h, hkv, d, cap, [past])
    model = _model(True, h, hkv, d, 1.0 / np.sqrt(d), local_window_size=window)
    cuda = _session(model, ops_lib, cuda="ort")
    want = cuda.run(None, feeds)[0]
    for name in ("past_key", "past_value"):
        feeds[name][:, :, : past + 1 - window] = np.nan
    got = cuda.run(None, feeds)[0]
    assert np.isfinite(got).all()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("attrs,d", [(dict(softcap=50.0), 256), (dict(local_window_size=4096), 64),
                                     (dict(softcap=50.0, local_window_size=8), 256), (dict(local_window_size=-1), 128)])
def test_pass_carries_softcap_and_window(attrs, d):
    """Gemma 2/3 and Mistral layers: softcap and local_window_size go onto the new node as they were
    (their "off" values are left off); head size 256 is taken."""
    from enginesmith.passes.lower.ort_attention import ort_attention

    model = _pass_model(h=8, hkv=4, d=d, **attrs)
    assert ort_attention(model).counts == {"attention": 1}
    (node,) = list(model.graph)
    assert (node.domain, node.op_type) == ("com.enginesmith", "GroupQueryAttention")
    carried = {k: v.value for k, v in node.attributes.items() if k in ("softcap", "local_window_size")}
    assert carried == {k: v for k, v in attrs.items() if v != -1}
