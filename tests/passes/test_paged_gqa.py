"""paged_gqa (com.enginesmith.GroupQueryAttention -> PagedGroupQueryAttention) and the paged CUDA build.

Structure (no library needed): the paged interface, what is refused and why, build.json and the CLI.
Numerics (libenginesmith_ort_ops.so from tests/conftest.py's ort_ops_lib: both ops' CPU kernels): the
paged graph, fed two rows of different lengths in one step (right-padded, pages scattered over the
pool), gives the logits of the dense graph it came from (the oracle) fed each row alone, through a
chunked prefill, decode steps and a multi-token step; on a GPU, the paged graph on ORT's CUDA EP too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.passes import run_pipeline
from enginesmith.passes.kv.ort_paged_gqa import PagedGqaParams, paged_gqa

CAPACITY = 64
DENSE_STEPS = f"lower_gqa:capacity={CAPACITY},skip_rmsnorm,matmul_transb,ort_gemv,ort_attention"


@pytest.fixture(scope="module")
def fp16_engine():
    """Tiny llama fp16 with head size 64 (enginesmith's attention op applies), plain ORT engine dir."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    return cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)


@pytest.fixture(scope="module")
def dense_graph(fp16_engine, tmp_path_factory) -> Path:
    """The CUDA-lowered graph with the custom ops (what --for-cuda --custom-attention builds)."""
    out = tmp_path_factory.mktemp("dense") / "model.onnx"
    report = run_pipeline(fp16_engine / "model.onnx", out, DENSE_STEPS, progress=False)
    assert report[-1]["counts"] == {"attention": 2}
    return out


def _paged(dense: Path, out_dir: Path, page_size: int = 16) -> tuple[Path, dict]:
    out = out_dir / "model.onnx"
    report = run_pipeline(dense, out, f"paged_gqa:page_size={page_size}", progress=False)
    return out, report[-1]["counts"]


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


# ----------------------------------------------------------------------------- structure

@pytest.mark.parametrize("page_size", [16, 32])
def test_every_layer_is_paged_and_the_interface_is_the_pools(dense_graph, tmp_path, page_size):
    out, counts = _paged(dense_graph, tmp_path, page_size)
    assert counts == {"paged_gqa": 2}
    before = onnx.load(str(dense_graph), load_external_data=False).graph
    after = onnx.load(str(out), load_external_data=False)
    graph = after.graph
    ops = [(n.domain, n.op_type) for n in graph.node]
    assert ("com.enginesmith", "GroupQueryAttention") not in ops and ("com.microsoft", "GroupQueryAttention") not in ops
    paged = [n for n in graph.node if n.op_type == "PagedGroupQueryAttention"]
    assert len(paged) == 2 and {n.domain for n in paged} == {io_names.ORT_OPS_DOMAIN}
    dense = [n for n in before.node if n.op_type == "GroupQueryAttention"]
    for old, new in zip(dense, paged):
        assert {a.name: onnx.helper.get_attribute_value(a) for a in new.attribute} == \
            {a.name: onnx.helper.get_attribute_value(a) for a in old.attribute}
        assert list(new.input) == [old.input[0], old.input[1], old.input[2], *io_names.PAGED_INPUTS, *old.input[5:]]
        assert list(new.output[1:]) == list(old.output[1:])  # present.{i}.key/value keep their names

    blocks = -(-CAPACITY // page_size)
    pool = ["num_pages", page_size, 2, 64]  # tiny llama-hd64: Hkv 2, D 64
    inputs = {i.name: (i.type.tensor_type.elem_type, _dims(i)) for i in graph.input}
    assert [i.name for i in graph.input] == [io_names.INPUT_IDS, *io_names.PAGED_INPUTS] + \
        [io_names.past_name(i, k) for i in range(2) for k in ("key", "value")]
    i32, f16 = onnx.TensorProto.INT32, onnx.TensorProto.FLOAT16
    assert inputs[io_names.BLOCK_TABLES] == (i32, ["batch", blocks])
    assert inputs[io_names.CONTEXT_LENS] == (i32, ["batch"])
    assert inputs[io_names.SLOT_MAPPING] == (i32, ["batch", "sequence"])
    assert all(inputs[io_names.past_name(i, k)] == (f16, pool) for i in range(2) for k in ("key", "value"))
    outputs = {o.name: _dims(o) for o in graph.output}
    assert list(outputs) == [io_names.LOGITS] + [io_names.present_name(i, k) for i in range(2) for k in ("key", "value")]
    assert all(outputs[io_names.present_name(i, k)] == pool for i in range(2) for k in ("key", "value"))
    meta = {p.key: p.value for p in after.metadata_props}
    assert json.loads(meta["enginesmith.kv_layout"]) == {"type": "paged", "io": io_names.PAGED_GQA_IO,
                                                         "page_size": page_size, "capacity": CAPACITY}


def test_capacity_not_a_multiple_of_the_page_rounds_the_block_table_up(dense_graph):
    model = ir.load(dense_graph)
    model.metadata_props["enginesmith.kv_capacity"] = "100"
    paged_gqa(model, PagedGqaParams(page_size=32))
    tables = next(v for v in model.graph.inputs if v.name == io_names.BLOCK_TABLES)
    assert list(tables.shape) == ["batch", 4]


def test_page_size_must_be_one_the_op_takes():
    with pytest.raises(UserError, match="page_size=8") as info:
        PagedGqaParams(page_size=8)
    assert "16, 32, 64" in info.value.fix


def test_refuses_ort_attention_it_cannot_page_with_the_reason(tmp_path):
    """tiny llama's head size 16: ort_attention leaves ORT's GroupQueryAttention, which has no paged
    twin here; the pass names the layer and ort_attention's reason instead of half-paging the graph."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    src = cached_engine(BuildConfig(model="tiny:llama", dtype="fp16"), progress=False) / "model.onnx"
    dense = tmp_path / "dense" / "model.onnx"
    run_pipeline(src, dense, f"lower_gqa:capacity={CAPACITY},ort_attention", progress=False)
    with pytest.raises(UserError, match="head size 16 is not one of") as info:
        paged_gqa(ir.load(dense), PagedGqaParams())
    assert "needs enginesmith's attention op" in str(info.value) and "ort_attention" in info.value.fix


@pytest.mark.parametrize("attr,value", [("softcap", 50.0), ("local_window_size", 8)])
def test_carries_softcap_and_window_onto_the_paged_op(dense_graph, attr, value):
    """ort_attention carries Gemma's soft-capping and sliding windows onto enginesmith's dense op; the
    paged op takes the same attributes, layer by layer (numerics: tests/models/test_paged_families.py)."""
    model = ir.load(dense_graph)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    node.attributes[attr] = ir.AttrFloat32(attr, value) if isinstance(value, float) else ir.AttrInt64(attr, value)
    paged_gqa(model, PagedGqaParams())
    paged = [n for n in model.graph if n.op_type == "PagedGroupQueryAttention"]
    assert len(paged) == 2
    assert paged[0].attributes[attr].value == value and attr not in paged[1].attributes
    assert paged[0].attributes[attr].type == node.attributes[attr].type


def test_takes_head_size_256_with_gemma2s_options(tmp_path):
    """tiny:gemma2 (head size 256, soft-capped at 50, layer 0 sliding with a window of 8) is paged."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    src = cached_engine(BuildConfig(model="tiny:gemma2", dtype="fp16"), progress=False) / "model.onnx"
    dense = tmp_path / "dense" / "model.onnx"
    run_pipeline(src, dense, f"fuse_attention,lower_gqa:capacity={CAPACITY},ort_attention", progress=False)
    model = ir.load(dense)
    assert paged_gqa(model, PagedGqaParams()).counts == {"paged_gqa": 2}
    got = [(n.attributes["softcap"].value, n.attributes.get("local_window_size") and n.attributes["local_window_size"].value)
           for n in model.graph if n.op_type == "PagedGroupQueryAttention"]
    assert got == [(50.0, 8), (50.0, None)]
    assert model.graph.inputs[-1].shape[3] == 256  # the pools [num_pages, BS, Hkv, 256]


def test_refuses_graphs_that_are_not_lowered_with_the_custom_attention(fp16_engine, dense_graph, tmp_path):
    with pytest.raises(UserError, match="lowered by lower_gqa"):  # no capacity metadata: not lowered at all
        paged_gqa(ir.load(fp16_engine / "model.onnx"), PagedGqaParams())
    gqa_only = tmp_path / "gqa" / "model.onnx"
    run_pipeline(fp16_engine / "model.onnx", gqa_only, f"lower_gqa:capacity={CAPACITY}", progress=False)
    with pytest.raises(UserError, match=r"ORT's GroupQueryAttention, not enginesmith's \(ort_attention was not run\)"):
        paged_gqa(ir.load(gqa_only), PagedGqaParams())
    out, _ = _paged(dense_graph, tmp_path)
    with pytest.raises(UserError, match="already has a paged KV layout"):
        paged_gqa(ir.load(out), PagedGqaParams())


def test_refuses_a_past_read_besides_the_attention(dense_graph):
    model = ir.load(dense_graph)
    graph = model.graph
    past = next(v for v in graph.inputs if v.name == io_names.past_key(1))
    shape = ir.Node("", "Shape", [past], name="reads_the_past")
    graph.append(shape)
    shape.outputs[0].name = "past_shape"
    graph.outputs.append(shape.outputs[0])
    with pytest.raises(UserError, match=r"past_key_values.1.key is read by Shape besides the attention"):
        paged_gqa(model, PagedGqaParams())


# ----------------------------------------------------------------------------- build and CLI

@pytest.fixture
def no_library_needed(monkeypatch):
    """The paged build asks for the ops library; lowering an fp16 graph never runs it (nothing to
    compare on fp16 graphs), so these tests do not need it built."""
    from enginesmith.plugins import ort_ops

    monkeypatch.setattr(ort_ops, "require", lambda: Path("libenginesmith_ort_ops.so"))


def test_an_ort_cuda_build_from_an_engine_writes_the_paged_engine(fp16_engine, tmp_path, no_library_needed):
    from enginesmith.builder.engine import BuildConfig, build
    from enginesmith.core import engine_dir

    out = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=CAPACITY, kv_layout="paged", page_size=32),
                            tmp_path / "e", source=fp16_engine, progress=False)
    manifest = engine_dir.verify(out, onnx_graph=True)  # the manifest reader accepts the paged io
    assert manifest.kv_layout.as_dict() == {"type": "paged", "io": "paged-gqa", "page_size": 32,
                                            "capacity": CAPACITY, "max_batch": 64}
    assert [p.split(":")[0] for p in manifest.passes[-3:]] == ["ort_gemv", "ort_attention", "paged_gqa"]
    assert manifest.passes[-1] == "paged_gqa:page_size=32"
    assert json.loads((out / "build.json").read_text())["pass_counts"]["paged_gqa"] == {"paged_gqa": 2}
    names = {i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.input}
    assert set(io_names.PAGED_INPUTS) <= names and "seqlens_k" not in names


def test_cli_builds_a_paged_cuda_engine(tmp_path, capsys, no_library_needed):
    from enginesmith import cli

    out = tmp_path / "e"
    assert cli.main(["build", "--model", "tiny:llama-hd64", "--dtype", "fp16", "--for-cuda", "--kv", "paged",
                     "--page-size", "64", "--max-batch", "8", "--out", str(out)]) == 0, capsys.readouterr().err
    layout = json.loads((out / "build.json").read_text())["kv_layout"]
    assert layout == {"type": "paged", "io": "paged-gqa", "page_size": 64, "capacity": 512, "max_batch": 8}


@pytest.mark.parametrize("extra, word", [
    (["--dtype", "fp16", "--custom-ops", "off"], "--for-cuda --kv paged needs the custom ops"),
    (["--dtype", "bf16"], "which is fp16 (got --dtype bf16)"),
    (["--dtype", "fp16", "--page-size", "8"], "--page-size 8 is not one the paged attention op takes"),
    (["--dtype", "fp16", "--max-batch", "300"], "--max-batch 300 is outside 1..256"),
])
def test_cli_refuses_paged_cuda_combinations_before_any_work(tmp_path, capsys, extra, word):
    from enginesmith import cli

    out = tmp_path / "e"
    assert cli.main(["build", "--model", "tiny:llama", "--for-cuda", "--kv", "paged", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and word in err and "(fix: " in err and "\n" not in err
    assert not out.exists()


def test_cli_page_size_still_needs_kv_paged(tmp_path, capsys):
    from enginesmith import cli

    assert cli.main(["build", "--model", "tiny:llama", "--dtype", "fp16", "--for-cuda", "--page-size", "32",
                     "--out", str(tmp_path / "e")]) == 2
    assert "--page-size applies to --kv paged, not --kv dense" in capsys.readouterr().err


@pytest.mark.parametrize("layout, words", [
    ({"type": "paged", "page_size": 16, "io": "paged-gqa"}, None),
    ({"type": "dense", "io": "gqa-shared-buffer"}, None),
    ({"type": "dense", "io": "paged-gqa"}, "belongs to type paged, not dense"),
    ({"type": "paged", "page_size": 16, "io": "gqa-shared-buffer"}, "belongs to type dense, not paged"),
    ({"type": "paged", "page_size": 16, "io": "vllm"}, "'gqa-shared-buffer' or 'paged-gqa' or absent"),
])
def test_manifest_reads_the_paged_io_and_refuses_others(layout, words):
    from enginesmith.core import manifest

    doc = {"format_version": manifest.FORMAT_VERSION, "graph": "model.onnx",
           "files": {"model.onnx": {"sha256": "0" * 64, "size": 1}}, "model": {"max_positions": 64},
           "backend": {"name": "onnxruntime"}, "kv_layout": layout}
    if words is None:
        assert manifest.parse(doc).kv_layout.io == layout["io"]
    else:
        with pytest.raises(manifest.ManifestError, match=words):
            manifest.parse(doc)


# ----------------------------------------------------------------------------- numerics (the ops' CPU kernels)

def _cuda_ep() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def _session(path: Path, ops_lib: Path, device: str = "cpu"):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.register_custom_ops_library(str(ops_lib))
    if device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), opts, providers=providers)


class DenseRow:
    """The oracle: the dense es-GQA graph fed one row alone (its own [1, Hkv, C, D] buffers)."""

    def __init__(self, session):
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.past = [n for n in inputs if io_names.is_past(n)]
        self.outputs = [o.name for o in session.get_outputs()]
        shape = inputs[self.past[0]].shape
        self.kv = {n: np.zeros((1, shape[1], CAPACITY, shape[3]), np.float16) for n in self.past}
        self.length = 0

    def step(self, ids: list[int]) -> np.ndarray:
        total = self.length + len(ids)
        feeds = {io_names.INPUT_IDS: np.array([ids], np.int64), "seqlens_k": np.array([total - 1], np.int32),
                 "total_sequence_length": np.array(total, np.int32), **self.kv}
        out = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        self.kv = {p: out[io_names.present_of(p)] for p in self.past}
        self.length = total
        return out[io_names.LOGITS][0].astype(np.float32)  # [S, V]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _cuda_ep(), reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")])])
def test_paged_graph_gives_the_dense_graphs_logits(dense_graph, ort_ops_lib, tmp_path, device):
    """Two rows of different lengths share each step (right-padded, slot -1), their pages scattered over
    the pool (rows cross page boundaries, unowned pages hold NaN that must never be read); every real
    column's logits equal the dense graph's for that row alone (on the CPU: the op's CPU kernel; on
    the GPU: the paged graph on ORT's CUDA EP, its CUDA kernels, against the same CPU oracle)."""
    from enginesmith.core.kv_layout import paged_step

    page = 16
    paged, _ = _paged(dense_graph, tmp_path, page)
    dense_session, paged_session = _session(dense_graph, ort_ops_lib), _session(paged, ort_ops_lib, device)
    oracle = [DenseRow(dense_session), DenseRow(dense_session)]
    inputs = {i.name: i for i in paged_session.get_inputs()}
    past = [n for n in inputs if io_names.is_past(n)]
    outputs = [o.name for o in paged_session.get_outputs()]
    num_pages, blocks = 12, -(-CAPACITY // page)
    hkv, d = (int(x) for x in inputs[past[0]].shape[2:])
    pools = {n: np.full((num_pages, page, hkv, d), np.nan, np.float16) for n in past}
    owned = [[7, 2, 10], [4, 9]]  # each row's pages, in order; page 0 is the null page
    for pool in pools.values():
        pool[0] = 0
        pool[[p for ids in owned for p in ids]] = 0  # pools start zeroed; unowned pages stay NaN

    rng = np.random.default_rng(0)
    lengths = [0, 0]
    # (tokens per row) per step: prompts of 20 and 6 tokens in chunks of at most 16 (the op's query
    # length), row 0 crossing into its second page; decode steps; a 3 + 1 token (verify-like) step
    for counts in ([16, 5], [4, 1], [1, 1], [1, 1], [3, 1], [1, 1]):
        width = max(counts)
        tokens = [rng.integers(3, 49152, n).tolist() for n in counts]
        step = paged_step(owned, page, lengths, counts, width)
        tables = np.zeros((2, blocks), np.int32)
        tables[:, :step.block_tables.shape[1]] = step.block_tables
        ids = np.zeros((2, width), np.int64)
        for r, row in enumerate(tokens):
            ids[r, :len(row)] = row
        feeds = {io_names.INPUT_IDS: ids, io_names.BLOCK_TABLES: tables, io_names.CONTEXT_LENS: step.context_lens,
                 io_names.SLOT_MAPPING: step.slot_mapping, **pools}
        out = dict(zip(outputs, paged_session.run(outputs, feeds)))
        pools = {p: out[io_names.present_of(p)] for p in past}
        for r, row in enumerate(tokens):
            want = oracle[r].step(row)
            got = out[io_names.LOGITS][r, :len(row)].astype(np.float32)
            assert np.isfinite(got).all(), (counts, r)
            diff = float(np.abs(got - want).max())
            assert diff <= 2e-3 * float(np.abs(want).max()) + 2e-3, (counts, r, diff)
            lengths[r] += len(row)

    # the pools hold each row's K/V where its block table puts them; pads wrote nothing
    for name in past:
        pool = pools[name].astype(np.float32)
        for r, ids in enumerate(owned):
            flat = pool[ids].reshape(-1, hkv, d)[:lengths[r]]          # [T, Hkv, D]
            dense = oracle[r].kv[name][0, :, :lengths[r]].transpose(1, 0, 2).astype(np.float32)
            assert np.abs(flat - dense).max() <= 2e-3 * float(np.abs(dense).max()) + 2e-3, (name, r)
            assert not pool[ids].reshape(-1, hkv, d)[lengths[r]:].any(), (name, r)  # nothing past the row
        assert not pool[0].any()                                          # the null page untouched
        unowned = [p for p in range(1, num_pages) if all(p not in ids for ids in owned)]
        assert np.isnan(pool[unowned]).all()                              # never written
