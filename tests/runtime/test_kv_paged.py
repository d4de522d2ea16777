"""kv_layout=paged: the kv_paged pass, its lowerings and the runtime's paged cache.

- the paged graph (cpu lowering) on ORT CPU gives the dense graph's logits: every tiny family,
  page sizes that make sequences cross pages, a left-padded batch, prefill + decode; greedy
  generation is token-identical;
- the decomposed op equals the PyTorch reference of the plugin (plugins/reference.py) on random
  pools with shuffled pages, GQA, multi-token queries and padding slots;
- the pools are written in place; a fork with copy-on-write continues exactly like the solo runs;
- the TensorRT lowering writes plugin nodes the plugin library accepts (deploy.trt_lint), the CUDA
  lowering follows com.microsoft.PagedAttention's schema as the installed ONNX Runtime registers it;
- bad input (unsupported head/page size, fp32 for the half-precision kernels, a block table out of
  range, inconsistent slots) is refused with a message that names it.
Dense graphs come from `enginesmith.export.to_onnx.export` (the tiny engines of conftest, and a
head-size-64 fp16 model exported here once into the cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from enginesmith.core.errors import UserError
from enginesmith.passes import PassCheckError, run_pipeline
from enginesmith.passes.kv.kv_paged import KVPagedParams, kv_paged
from enginesmith.passes.lower.paged_lower import lower_paged_graph
from enginesmith.runtime.kv.kv_paged import PagedKVCache, PagedKVPool, PagedStep, build_step, check_step
from enginesmith.runtime.engines.ort_engine import OrtEngine

from helpers.paged_graphs import h64_fp16_graph, make_paged, paged  # noqa: F401  (paged: the fixture)
from helpers.tiny_families import FAMILIES
ATOL = 1e-4
VOCAB = 49152


@pytest.fixture(scope="module")
def h64():
    return h64_fp16_graph()


def paged_engine(path: Path) -> OrtEngine:
    engine = OrtEngine(path, device="cpu", threads=1)
    engine.new_cache = lambda batch: PagedKVCache.for_session(engine.session, batch, "cpu", max_tokens=64)
    return engine


def left_padded_run(engine, cache, prompts, steps: np.ndarray) -> list[np.ndarray]:
    """Logits of a left-padded prefill of `prompts`, then one decode step per row of `steps`;
    pad columns are dropped (each entry: [B, real tokens or 1, V] as a list of per-row arrays)."""
    from enginesmith.runtime.decoding.generate import left_pad, positions

    ids, mask = left_pad(prompts, 0)
    out = engine.forward(ids, mask, positions(mask, ids.shape[1]), cache)
    logits = [[out[r, ids.shape[1] - len(p):] for r, p in enumerate(prompts)]]
    for step in steps:
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        out = engine.forward(step[:, None], mask, positions(mask, 1), cache)
        logits.append([out[r] for r in range(len(prompts))])
    return logits


@pytest.mark.parametrize("family,page_size", [(f, 4) for f in FAMILIES] + [("llama", 16)])
def test_paged_graph_matches_dense_logits(family, page_size, paged):
    dense_path, paged_path, report = paged(family, page_size)
    assert report["counts"] == {"paged_layers": 2, "lowered": 2} and report["exact"]
    assert report["max_diff"] <= report["tolerance"]              # the pass manager compared it
    ops = {n.op_type for n in ir.load(paged_path).graph}
    assert {"ScatterND", "Gather", "Attention", "Compress"} <= ops and "Concat" in ops
    inputs = {v.name for v in ir.load(paged_path).graph.inputs}
    assert {"block_tables", "context_lens", "slot_mapping"} <= inputs and "attention_mask" not in inputs
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 9, 14)]  # 14 tokens: 4 pages of 4
    steps = rng.integers(0, VOCAB, (6, 3))
    dense = OrtEngine(dense_path, device="cpu", threads=1)
    engine = paged_engine(paged_path)
    got = left_padded_run(engine, engine.new_cache(3), prompts, steps)
    want = left_padded_run(dense, dense.new_cache(3), prompts, steps)
    worst = max(float(np.abs(a - b).max()) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst <= ATOL, worst


def test_greedy_generation_is_token_identical(paged):
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids

    dense_path, paged_path, _ = paged("qwen2", 4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 5, 6, 7]]
    config = GenerationConfig(max_new_tokens=24)
    want = np.stack([i for i, _ in generate_ids(OrtEngine(dense_path, device="cpu", threads=1), prompts, config)])
    got = np.stack([i for i, _ in generate_ids(paged_engine(paged_path), prompts, config)])
    np.testing.assert_array_equal(got, want)


def _single_op_graph(b, s, h, hkv, d, bs, dtype=ir.DataType.FLOAT) -> ir.Model:
    """One enginesmith.PagedAttention node with its inputs and outputs as graph I/O."""
    def value(name, shape, t=dtype):
        return ir.Value(name=name, type=ir.TensorType(t), shape=ir.Shape(shape))

    i32 = ir.DataType.INT32
    inputs = [value("query", [b, s, h, d]), value("key", [b, s, hkv, d]), value("value", [b, s, hkv, d]),
              value("k_cache", ["nb", bs, hkv, d]), value("v_cache", ["nb", bs, hkv, d]),
              value("block_tables", [b, "mb"], i32), value("context_lens", [b], i32),
              value("slot_mapping", [b, s], i32)]
    attrs = [ir.AttrInt64("num_heads", h), ir.AttrInt64("num_kv_heads", hkv), ir.AttrInt64("head_size", d),
             ir.AttrInt64("block_size", bs), ir.AttrFloat32("scale", 0.0), ir.AttrInt64("write_kv", 1)]
    node = ir.Node("enginesmith", "PagedAttention", inputs, attrs, num_outputs=3, name="pa")
    for out, name, like in zip(node.outputs, ("out", "k_cache_out", "v_cache_out"), (inputs[0], inputs[3], inputs[4])):
        out.name, out.type, out.shape = name, like.type, like.shape
    graph = ir.Graph(inputs, list(node.outputs), nodes=[node], opset_imports={"": 23, "enginesmith": 1})
    return ir.Model(graph, ir_version=10)


def test_decomposed_op_matches_the_plugin_reference():
    import onnxruntime as ort
    import torch

    from enginesmith.plugins import reference

    b, s, h, hkv, d, bs = 3, 3, 8, 2, 16, 4
    model = _single_op_graph(b, s, h, hkv, d, bs)
    assert lower_paged_graph(model, "cpu") == 1
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(0)
    ctx_lens = [5, 11, 3]                                     # row 2: context == S (all new)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(b, ctx_lens, hkv, d, bs, torch.float32, "cpu",
                                                               generator=gen)
    tables[tables < 0] = 0                                    # the null-page convention of the runtime
    pos = ctx[:, None].long() - s + torch.arange(s)[None]
    slots = (tables.long().gather(1, pos // bs) * bs + pos % bs).to(torch.int32)
    slots[0, 0] = -1                                          # a padding column: not written
    q = torch.randn(b, s, h, d, generator=gen)
    k, v = torch.randn(b, s, hkv, d, generator=gen), torch.randn(b, s, hkv, d, generator=gen)
    feeds = {"query": q, "key": k, "value": v, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
             "context_lens": ctx, "slot_mapping": slots}
    out, k_after, v_after = session.run(None, {n: t.numpy() for n, t in feeds.items()})
    reference.write_kv(k, v, slots, k_cache, v_cache)
    np.testing.assert_allclose(k_after, k_cache.numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(v_after, v_cache.numpy(), rtol=0, atol=0)
    want = reference.paged_attention(q, k_cache, v_cache, tables, ctx).numpy()
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)


def test_pools_are_written_in_place(paged):
    _, paged_path, _ = paged("llama", 4)
    engine = paged_engine(paged_path)
    cache = engine.new_cache(2)
    pointers = [v.data_ptr() for v in cache.pool.values]
    assert all(not a.any() for a in cache.pool.host_arrays())
    rng = np.random.default_rng(1)
    left_padded_run(engine, cache, [[1, 2, 3, 4, 5], [6, 7]], rng.integers(0, VOCAB, (3, 2)))
    assert [v.data_ptr() for v in cache.pool.values] == pointers
    written = cache.manager.num_tokens("row0") + cache.manager.num_tokens("row1")
    assert written == 5 + 2 + 2 * 3
    assert all(int(np.count_nonzero(np.abs(a).sum(axis=(2, 3)))) == written for a in cache.pool.host_arrays())


def test_fork_with_copy_on_write_matches_solo_runs(paged):
    """A prompt's cache is forked; the branches continue with different tokens. The child's first
    write lands in the shared, half-full page: copy-on-write. Both equal their dense solo runs."""
    from enginesmith.runtime.kv.block_manager import KVCacheManager

    dense_path, paged_path, _ = paged("mistral", 4)
    engine = OrtEngine(paged_path, device="cpu", threads=1)
    dense = OrtEngine(dense_path, device="cpu", threads=1)
    pool = PagedKVPool.for_session(engine.session, 16)
    manager = KVCacheManager(16, pool.page_size)
    prompt = [11, 12, 13, 14, 15, 16]                         # 6 tokens: page 2 half full
    branches = {"a": [21, 22, 23], "b": [31, 32, 33]}

    def run(rows, starts, tokens):
        blocks = [manager.allocate_slots(r, len(t)) for r, t in zip(rows, tokens)]
        pool.copy_pages([c for blk in blocks for c in blk.copies])
        step = build_step(manager, rows, starts, [len(t) for t in tokens], max(len(t) for t in tokens))
        pool.prepare(step)
        ids = np.zeros(step.slot_mapping.shape, np.int64)
        for r, t in enumerate(tokens):
            ids[r, :len(t)] = t
        return engine.forward(ids, np.ones_like(ids), step.position_ids, pool), blocks

    run(["a"], [0], [prompt])
    manager.fork("a", "b")
    got = {"a": [], "b": []}
    copies = []
    for i in range(3):
        logits, blocks = run(["b", "a"], [6 + i, 6 + i], [[branches["b"][i]], [branches["a"][i]]])
        copies += [c for blk in blocks for c in blk.copies]
        got["b"].append(logits[0, 0])
        got["a"].append(logits[1, 0])
    assert len(copies) == 1                                   # the shared page, copied once
    manager.check_invariants()
    for name, tokens in branches.items():
        cache = dense.new_cache(1)
        ids = np.array([prompt + tokens])
        want = dense.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], cache)[0, 6:]
        np.testing.assert_allclose(np.stack(got[name]), want, rtol=0, atol=ATOL)


def test_trt_lowering_writes_plugin_nodes_the_library_accepts(h64, tmp_path):
    from enginesmith.builder import trt_lint

    out = tmp_path / "trt" / "model.onnx"
    report = make_paged(h64, out, 16, lower="trt")
    assert report["counts"] == {"paged_layers": 2, "lowered": 2}
    model = ir.load(out)
    nodes = [n for n in model.graph if n.op_type == "PagedAttention"]
    assert len(nodes) == 2 and all(n.domain == "trt.plugins" for n in nodes)
    fields = {"num_heads", "num_kv_heads", "head_size", "block_size", "scale", "write_kv"}
    for node in nodes:
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert set(attrs) == fields | {"plugin_version", "plugin_namespace"}
        assert attrs["plugin_version"] == "1" and attrs["plugin_namespace"] == "enginesmith"
        assert (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_size"], attrs["block_size"]) == (2, 1, 64, 16)
        assert [v.type.dtype for v in node.inputs[5:]] == [ir.DataType.INT32] * 3
    assert json.loads(model.metadata_props["enginesmith.kv_layout"]) == {"type": "paged", "page_size": 16,
                                                                       "lower": "trt"}
    assert trt_lint.lint(out, "11") == []
    proto = ir.to_proto(model)  # the lint does check these nodes: a missing field is reported
    node = next(n for n in proto.graph.node if n.op_type == "PagedAttention")
    del node.attribute[[a.name for a in node.attribute].index("block_size")]
    assert any("required field 'block_size' is missing" in f.message for f in trt_lint.lint(proto, "11"))


def test_fp16_cpu_lowering_matches_dense(h64, tmp_path):
    out = tmp_path / "cpu" / "model.onnx"
    report = make_paged(h64, out, 16)
    assert report["exact"] and report["max_diff"] <= report["tolerance"]


def test_broken_paged_rewrite_fails_the_pipeline_loudly(tiny_engine, tmp_path, monkeypatch):
    """kv_paged (lower=cpu) is exact: a paged graph that computes something else than the dense one
    (here one layer's attention scale doubled) stops the pipeline and leaves no output behind.
    With verify=false the same graph goes through: the manager's comparison is what caught it."""
    import enginesmith.passes.kv.kv_paged as module

    rewrite = module.rewrite_paged

    def broken(model, page_size):
        counts = rewrite(model, page_size)
        node = next(n for n in model.graph if n.op_type == "PagedAttention")
        node.attributes["scale"] = ir.AttrFloat32("scale", 2 * node.attributes["scale"].value)
        return counts

    monkeypatch.setattr(module, "rewrite_paged", broken)
    dense, out = tiny_engine("llama") / "model.onnx", tmp_path / "out"
    with pytest.raises(PassCheckError, match=r"exact pass kv_paged:page_size=4 changed the logits by"):
        make_paged(dense, out / "model.onnx", 4)
    assert list(out.iterdir()) == []
    (report,) = run_pipeline(dense, out / "model.onnx", "kv_paged:page_size=4,verify=false", progress=False)
    assert not report["exact"] and report["max_diff"] is None


def test_cuda_lowering_follows_the_ort_contrib_schema(h64, tmp_path):
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    schema = next(s for s in C.get_all_operator_schema() if s.name == "PagedAttention" and s.domain == "com.microsoft")
    out = tmp_path / "cuda" / "model.onnx"
    make_paged(h64, out, 16, lower="cuda")
    model = ir.load(out)
    assert model.opset_imports.get("com.microsoft") == 1 and "enginesmith" not in model.opset_imports
    nodes = [n for n in model.graph if n.op_type == "PagedAttention"]
    assert len(nodes) == 2 and all(n.domain == "com.microsoft" for n in nodes)
    names = [p.name for p in schema.inputs]
    types = {"T": {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}, "T_CACHE": {ir.DataType.FLOAT16},
             "S": {ir.DataType.INT32}}
    for node in nodes:
        assert len(node.inputs) <= len(names)
        given = {names[i]: v for i, v in enumerate(node.inputs) if v is not None}
        assert set(given) == {"query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
                              "past_seqlens", "block_table", "slot_mapping"}
        for i, param in enumerate(schema.inputs):
            if names[i] in given:
                assert given[names[i]].type.dtype in types[param.typeStr], (names[i], given[names[i]].type)
        attrs = set(node.attributes)
        assert attrs <= set(schema.attributes)
        assert {a for a, spec in schema.attributes.items() if spec.required} <= attrs
        assert node.attributes["is_causal"].value == 1 and len(node.outputs) == 3
    # The caches are the graph's outputs (aliased in place by the op).
    assert {v.name for v in model.graph.outputs} >= {"present.0.key", "present.1.value"}


def _cuda_ep() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep(), reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("lens", [(9, 9), (3, 9, 14)], ids=["equal-prompts", "left-padded"])
def test_cuda_lowering_runs_on_ort_cuda_like_the_dense_graph(h64, tmp_path, lens):
    """The cuda lowering (com.microsoft.PagedAttention) on ORT's CUDA EP, pools on the device: the
    same logits as the dense fp16 graph on the same EP over a prefill and decode steps crossing a
    page boundary, and the same greedy tokens."""
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids

    out = tmp_path / "cuda" / "model.onnx"
    make_paged(h64, out, 16, lower="cuda")
    engine = OrtEngine(out, device="cuda", threads=1)
    assert engine.session.get_providers()[0] == "CUDAExecutionProvider"
    engine.new_cache = lambda batch: PagedKVCache.for_session(engine.session, batch, "cuda", max_tokens=64)
    dense = OrtEngine(h64, device="cuda", threads=1)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in lens]
    steps = rng.integers(0, VOCAB, (10, len(lens)))  # 14 + 10 tokens: past the first 16-token page
    got = left_padded_run(engine, engine.new_cache(len(lens)), prompts, steps)
    want = left_padded_run(dense, dense.new_cache(len(lens)), prompts, steps)
    scale = max(float(np.abs(w).max()) for g in want for w in g)
    worst = max(float(np.abs(a - b).max()) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst <= 2e-3 * scale + 2e-3, f"max |paged - dense| {worst} (logits up to {scale})"
    config = GenerationConfig(max_new_tokens=20)
    ids_paged = np.stack([i for i, _ in generate_ids(engine, prompts, config)])
    ids_dense = np.stack([i for i, _ in generate_ids(dense, prompts, config)])
    np.testing.assert_array_equal(ids_paged, ids_dense)


def test_bad_input_is_refused_with_the_reason(paged, h64, tiny_engine, tmp_path):
    llama = tiny_engine("llama") / "model.onnx"
    half = ir.DataType.FLOAT16
    with pytest.raises(UserError, match=r"head size 96 is not supported by the TensorRT plugin \(supported: 64, 128, 256\)"):
        lower_paged_graph(_single_op_graph(1, 1, 2, 1, 96, 16, half), "trt")
    with pytest.raises(UserError, match="float16/bfloat16, the graph is"):
        make_paged(llama, tmp_path / "a" / "model.onnx", 16, lower="trt")
    with pytest.raises(UserError, match="page size 8 is not supported"):
        make_paged(h64, tmp_path / "b" / "model.onnx", 8, lower="trt")
    with pytest.raises(UserError, match="float16/bfloat16"):
        lower_paged_graph(_single_op_graph(1, 1, 2, 1, 64, 16), "trt")
    with pytest.raises(UserError, match="float16/bfloat16"):
        make_paged(llama, tmp_path / "c" / "model.onnx", 16, lower="cuda")
    with pytest.raises(UserError, match="page_size"):
        KVPagedParams(page_size=0)
    with pytest.raises(UserError, match="lower='gpu'"):
        KVPagedParams(lower="gpu")
    _, paged_path, _ = paged("llama", 4)
    with pytest.raises(UserError, match="already has a paged KV layout"):
        kv_paged(ir.load(paged_path), KVPagedParams(4, verify=False))

    steps = dict(block_tables=np.array([[1, 2]], np.int32), context_lens=np.array([6], np.int32),
                 slot_mapping=np.array([[4 * 2 + 1]], np.int32), position_ids=np.array([[5]]))
    check_step(PagedStep(**steps), num_pages=4, page_size=4)  # position 5 -> page 2, offset 1: fine
    with pytest.raises(UserError, match="block table out of range: row 0 entry 1 is page 9"):
        check_step(PagedStep(**{**steps, "block_tables": np.array([[1, 9]], np.int32)}), 4, 4)
    with pytest.raises(UserError, match="context length 9 of row 0 is outside"):
        check_step(PagedStep(**{**steps, "context_lens": np.array([9], np.int32)}), 4, 4)
    with pytest.raises(UserError, match="writes slot 5 but its position 5 lives at slot 9"):
        check_step(PagedStep(**{**steps, "slot_mapping": np.array([[5]], np.int32)}), 4, 4)
    with pytest.raises(UserError, match="slot mapping out of range"):
        check_step(PagedStep(**{**steps, "slot_mapping": np.array([[99]], np.int32)}), 4, 4)
    cache = PagedKVCache.for_session(OrtEngine(paged_path, device="cpu", threads=1).session, 1, num_pages=2)
    with pytest.raises(UserError, match="pool .* is full"):
        cache.feeds(np.ones((1, 9), np.int64), np.zeros((1, 9), np.int64))  # 9 tokens > 1 page of 4


def test_rollback_and_row_selection(paged):
    """truncate (speculative decoding's rollback) forgets positions, select drops rows and returns
    their pages; the logits that follow equal the dense cache's after the same operations."""
    dense_path, paged_path, _ = paged("llama", 4)
    engines = {"dense": OrtEngine(dense_path, device="cpu", threads=1), "paged": paged_engine(paged_path)}
    rng = np.random.default_rng(4)
    ids = rng.integers(0, VOCAB, (2, 9))
    retry = rng.integers(0, VOCAB, (2, 3))
    out = {}
    for name, engine in engines.items():
        cache = engine.new_cache(2)
        engine.forward(ids, np.ones_like(ids), np.arange(9)[None].repeat(2, 0), cache)
        cache.truncate(6)                                      # drop the last 3 positions
        mask = np.ones((2, 9), np.int64)
        first = engine.forward(retry, mask, np.arange(6, 9)[None].repeat(2, 0), cache)
        cache.select(np.array([1]))
        nxt = engine.forward(retry[1:, :1], np.ones((1, 10), np.int64), np.array([[9]]), cache)
        out[name] = (first, nxt)
        if name == "paged":
            assert cache.manager.seqs.keys() == {"row1"} and cache.length == 10
            cache.manager.check_invariants()
            assert cache.manager.num_free_blocks == cache.pool.num_pages - 1 - 3  # 10 tokens: 3 pages
    for a, b in zip(out["paged"], out["dense"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


def test_paged_engine_from_build_generates_like_the_dense_engine(tiny_engine):
    """`enginesmith build --kv paged` end to end: build.json layout and greedy tokens equal dense."""
    from enginesmith.builder.engine import BuildConfig, cached_engine
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate
    from enginesmith.runtime.load import open_engine

    paged = open_engine(cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged", page_size=16),
                                      progress=False), device="cpu")
    dense = open_engine(tiny_engine("llama"), device="cpu")
    assert paged.manifest.kv_layout.as_dict() == {"type": "paged", "page_size": 16, "capacity": 512}
    assert paged.engine.kv_layout == "paged"
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    cfg = GenerationConfig(max_new_tokens=20)
    got = [c.token_ids for c in generate(paged.engine, paged.tokenizer, prompts, cfg)]
    want = [c.token_ids for c in generate(dense.engine, dense.tokenizer, prompts, cfg)]
    assert got == want
