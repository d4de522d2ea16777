"""The offline serving benchmark (enginesmith/measure/throughput.py, `enginesmith bench --requests`) on a tiny
paged engine (tiny:llama, --kv paged, ONNX Runtime CPU):

- the workload is a function of its seed; prompts are Austen paragraphs (the oracle: the corpus's
  own paragraphs), lengths stay within their clips, fixed lengths are exact;
- a closed-loop run finishes every request at exactly its drawn length, never has more than C
  requests in flight (read from the StepOutputs), gives every page back, also through preemption;
  its latency figures are ordered and positive;
- the CLI end to end (--json, --png) and its bad flags (one line, exit 2, no traceback);
- GPU (marked gpu): the CUDA paged engine (runtime/engines/paged_cuda.py) through the CLI: rows capped at its
  max_batch, chunks at its attention op's query limit, the bound over the GPU's copy bandwidth.
"""

from __future__ import annotations

import json
import statistics

import pytest

from enginesmith.core.errors import UserError
from enginesmith.measure import speed, throughput
from enginesmith.runtime.decoding.batching import StepOutput
from enginesmith.runtime.load import open_engine, paged_model
from helpers.external import needs_cuda
from helpers.paged_engine import gpu, monkeypatch_module, paged_dir  # noqa: F401, F811  (fixtures, markers)
from helpers.cli import assert_one_line_error, cli

VOCAB = 49152


@pytest.fixture(scope="module")
def engine_dir():
    from enginesmith.builder.engine import BuildConfig, cached_engine

    return cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged", page_size=16), progress=False)


@pytest.fixture(scope="module")
def loaded(engine_dir):
    return open_engine(engine_dir, device="cpu", threads=1)


def _paragraph_pieces(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n")]


def test_workload_is_seeded_and_made_of_austen_paragraphs(loaded, austen):
    tok = loaded.tokenizer
    first = throughput.workload(tok, 30, seed=3, max_prompt=3000, max_new=1000)
    assert first == throughput.workload(tok, 30, seed=3, max_prompt=3000, max_new=1000)
    assert first != throughput.workload(tok, 30, seed=4, max_prompt=3000, max_new=1000)
    prompts, outputs = [len(r.prompt) for r in first], [r.new_tokens for r in first]
    assert all(1 <= p <= 3000 for p in prompts) and all(1 <= t <= 1000 for t in outputs)
    assert len(set(prompts)) > 10 and len(set(outputs)) > 10  # drawn, not one length
    known = {p for book in throughput.paragraphs() for p in book}
    for r in first:  # whole paragraphs of the corpus, the last one maybe cut by the clip
        pieces = _paragraph_pieces(tok.decode(r.prompt))
        assert all(p in known for p in pieces[:-1]), pieces
        assert any(p.startswith(pieces[-1]) for p in known), pieces[-1]


def test_fixed_lengths_and_random_ids(loaded, austen):
    fixed = throughput.workload(loaded.tokenizer, 5, seed=0, prompt_tokens=300, new_tokens=7)
    assert {len(r.prompt) for r in fixed} == {300} and {r.new_tokens for r in fixed} == {7}
    assert len({r.prompt for r in fixed}) == 5
    rand = throughput.workload(VOCAB, 4, seed=1, prompt_tokens=16, new_tokens=3)
    assert all(len(r.prompt) == 16 and max(r.prompt) < VOCAB for r in rand)
    synthetic = throughput.workload(VOCAB, 40, seed=1, max_prompt=300, max_new=50)  # no corpus: drawn lengths
    assert synthetic == throughput.workload(VOCAB, 40, seed=1, max_prompt=300, max_new=50)
    assert len({len(r.prompt) for r in synthetic}) > 10 and max(len(r.prompt) for r in synthetic) <= 300
    assert len({r.new_tokens for r in synthetic}) > 10 and max(r.new_tokens for r in synthetic) <= 50
    with pytest.raises(UserError, match="requests"):
        throughput.workload(VOCAB, 0, seed=1, prompt_tokens=4, new_tokens=4)


def test_clips_keep_requests_inside_the_engine():
    assert throughput.clips(512, 128) == (289, 96)           # room 385: a quarter for the output
    assert throughput.clips(512, 128, new_tokens=100) == (285, 100)
    assert throughput.clips(512, 128, prompt_tokens=300) == (300, 85)
    assert throughput.clips(None, 128) == (throughput.MAX_PROMPT, throughput.MAX_NEW)
    with pytest.raises(UserError, match="exceeds the engine's 512 positions"):
        throughput.clips(512, 128, prompt_tokens=380, new_tokens=10)


def test_scheduler_rows_follow_concurrency_capped_by_the_model():
    assert throughput.scheduler_config(64).max_batch == 64
    assert throughput.scheduler_config(64, max_batch_rows=16).max_batch == 16
    assert throughput.scheduler_config(64, model_rows=8).max_batch == 8   # the CUDA engine's largest bucket
    config = throughput.scheduler_config(4, chunk=16)
    assert config.chunk == 16 and config.max_tokens >= 4 * 16


def _in_flight(steps: list[StepOutput]) -> int:
    """The most requests seen scheduled and not yet finished at once."""
    alive, most = set(), 0
    for s in steps:
        alive |= set(s.scheduled)
        most = max(most, len(alive))
        alive -= set(s.finished)
    return most


@pytest.mark.parametrize("pages, concurrency", [(200, 3), (12, 4)])  # 12 pages: too few for 4 at once
def test_run_offline_serves_every_request_to_its_length(loaded, austen, pages, concurrency):
    model = paged_model(loaded, num_pages=pages)
    requests = throughput.workload(loaded.tokenizer, 9, seed=5, max_prompt=60, max_new=12)
    weights, kv = throughput.model_sizes(model, loaded)
    steps: list[StepOutput] = []
    r = throughput.run_offline(model, requests, concurrency, throughput.scheduler_config(concurrency, chunk=32),
                               bandwidth_gbs=10.0, weight_bytes=weights, on_step=steps.append)
    assert r["requests"] == 9 and r["concurrency"] == concurrency and r["steps"] == len(steps)
    assert r["output_tokens"] == sum(q.new_tokens for q in requests) == sum(len(s.new_tokens) for s in steps)
    assert r["prompt_tokens"] == sum(len(q.prompt) for q in requests)
    assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
    assert r["leaked_pages"] == 0 and r["pages"]["total"] == pages - 1
    assert 0 < r["pages"]["mean"] <= r["pages"]["peak"] <= pages - 1
    assert _in_flight(steps) <= concurrency and max(len(s.scheduled) for s in steps) == r["max_batch"]
    for key in ("ttft_ms", "itl_ms"):
        assert 0 < r[key]["p50"] <= r[key]["p99"], key
    assert r["preemptions"] == 0  # admission by the pages a request needs: what is admitted finishes
    if pages == 200:
        assert r["max_batch"] == concurrency
    b = r["bound"]
    decode = [s for s in steps if s.width == 1 and len(s.scheduled) == b["batch"]]
    assert b["steps"] == len(decode) > 0 and b["batch"] == max(len(s.scheduled) for s in steps if s.width == 1)
    assert b["weight_bytes"] == weights == speed.onnx_weight_bytes(loaded.path / loaded.manifest.graph)
    m = loaded.manifest.model
    assert b["kv_bytes_per_token"] == kv == m.layers * 2 * m.kv_heads * m.head_dim * 4  # fp32 K and V
    fractions = [(weights + s.context_tokens * kv) / s.seconds / 10e9 for s in decode]  # bytes / s / (10 GB/s)
    assert b["fraction_median"] == pytest.approx(statistics.median(fractions)) and b["fraction_mean"] > 0


def test_bench_requests_cli_json_and_png(engine_dir, austen, tmp_path):
    png = tmp_path / "tput.png"
    result = cli("bench", "--engine", str(engine_dir), "--device", "cpu", "--threads", "1", "--requests", "6",
                 "--concurrency", "1,3", "--num-pages", "120", "--json", "--png", str(png))
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout)
    assert [run["concurrency"] for run in r["runs"]] == [1, 3] and r["workload"]["text"] == "austen"
    assert r["workload"]["prompt_tokens"] == "drawn" and r["device"] == "cpu" and r["num_pages"] == 119
    assert all(run["pages"]["total"] == r["num_pages"] for run in r["runs"])  # usable pages: the null page is not one
    assert len({run["output_tokens"] for run in r["runs"]}) == 1  # the same work at every concurrency
    assert all(run["leaked_pages"] == 0 and run["tok_s"] > 0 for run in r["runs"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_requests_cli_text_with_fixed_lengths(engine_dir, austen):
    result = cli("bench", "--engine", str(engine_dir), "--device", "cpu", "--threads", "1", "--requests", "4",
                 "--concurrency", "2", "--prompt-tokens", "40", "--new-tokens", "5", "--num-pages", "40")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "4 requests of austen, prompt 40 tokens" in out and "concurrency 2 " in out
    assert "20 output tokens" in out and "leaked 0" in out and "decode steps at batch 2" in out


@pytest.mark.parametrize("flags, word", [
    (["--requests", "0"], "--requests 0"),
    (["--requests", "4", "--concurrency", "0,2"], "--concurrency"),
    (["--requests", "4", "--concurrency", "2,x"], "not a list of integers"),
    (["--requests", "4", "--num-pages", "1"], "--num-pages"),
    (["--requests", "4", "--compare", "hf"], "--compare belongs to the single-stream bench"),
    (["--png", "x.png"], "--png belongs to the offline benchmark"),
    (["--requests", "4", "--png", "/no/such/dir/x.png"], "folder does not exist"),
    (["--requests", "4", "--prompt-tokens", "400", "--new-tokens", "10"], "exceeds the engine's 512 positions"),
    (["--requests", "4", "--prompt-tokens", "50", "--new-tokens", "10", "--num-pages", "3"], "needs 4 KV pages"),
])
def test_bench_requests_bad_flags(engine_dir, flags, word):
    assert_one_line_error(cli("bench", "--engine", str(engine_dir), "--device", "cpu", *flags), 2, word)


def test_png_without_matplotlib_is_one_clear_error(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find(name, *a))
    with pytest.raises(UserError, match="--png needs matplotlib") as err:
        throughput.require_matplotlib()
    assert "enginesmith[plot]" in err.value.fix


def test_bench_requests_on_a_dense_engine_says_to_build_paged(tiny_engine):
    result = cli("bench", "--engine", str(tiny_engine("llama")), "--device", "cpu", "--requests", "2")
    assert_one_line_error(result, 2, "no paged KV cache", "--kv paged")


@gpu
@needs_cuda
def test_gpu_bench_requests_on_the_cuda_paged_engine(paged_dir):  # noqa: F811  (the imported fixture)
    result = cli("bench", "--engine", str(paged_dir), "--device", "cuda", "--requests", "24", "--concurrency", "1,16",
                 "--prompt-tokens", "64", "--new-tokens", "32", "--num-pages", "256", "--json")
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout)
    assert r["device"] == "cuda" and r["backend"] == "PagedCudaEngine" and r["num_pages"] == 255
    one, many = r["runs"]
    assert many["max_batch_rows"] == many["max_batch"] == 16  # built with --max-batch 32: 16 in flight, 16 rows a step
    assert one["chunk"] == many["chunk"] == 16                # the paged attention op's query limit
    for run in (one, many):
        assert run["leaked_pages"] == 0 and run["output_tokens"] == 24 * 32
        assert run["bound"]["device"] == "cuda" and run["bound"]["fraction_median"] > 0
    # admission by pages (6 a request here, 255 in the pool) lets all 16 run at once: the bound is taken at the
    # median batch, 16 (H100, 2026-11-27; 8 under the earlier admission)
    assert many["bound"]["batch"] == 16 and many["tok_s"] > one["tok_s"]


def test_a_text_file_workload_and_synthetic_prompts_without_the_corpus(loaded, tmp_path, monkeypatch):
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(f"Paragraph {i} says something about item {i}, at some length." for i in range(40)))
    source, books, what = throughput.workload_source(loaded.tokenizer, VOCAB, str(text))
    assert what == "text of notes.txt" and len(books[0]) == 40
    requests = throughput.workload(source, 6, seed=2, max_prompt=200, max_new=20, books=books)
    for r in requests:
        assert all(p.startswith("Paragraph") for p in _paragraph_pieces(loaded.tokenizer.decode(r.prompt)))
    with pytest.raises(UserError, match="does not exist"):
        throughput.workload_source(loaded.tokenizer, VOCAB, str(tmp_path / "missing.txt"))

    def not_installed():
        raise UserError("the Jane Austen corpus is not installed", "install it")

    monkeypatch.setattr(throughput, "data_dir", not_installed)
    assert throughput.workload_source(loaded.tokenizer, VOCAB) == (VOCAB, None, throughput.SYNTHETIC)


NO_CORPUS = ("import sys; import enginesmith.models.corpus as c; c._LIB_DIRS = (); from enginesmith.cli import run; "
             "sys.argv[0] = 'enginesmith'; sys.exit(run())")


def test_bench_requests_works_without_the_corpus(engine_dir, tmp_path):
    """A new user's first hour: `bench --requests` right after the install (no corpus): synthetic prompts with
    a notice; --text FILE for real text."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("R_LIBS", "ENGINESMITH_JANEAUSTENR"))}
    base = [sys.executable, "-c", NO_CORPUS, "bench", "--engine", str(engine_dir), "--requests", "4",
            "--concurrency", "1,2", "--threads", "1", "--json"]
    proc = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "corpus is not installed, so the prompts are synthetic" in proc.stderr and "Traceback" not in proc.stderr
    result = json.loads(proc.stdout)
    assert result["workload"]["text"] == throughput.SYNTHETIC and len(result["runs"]) == 2
    text = tmp_path / "mine.txt"
    text.write_text("\n\n".join(f"My own paragraph number {i}." for i in range(20)))
    proc = subprocess.run(base + ["--text", str(text)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "notice" not in proc.stderr, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["workload"]["text"] == "text of mine.txt"
