"""Issue 28, part A: every number is bounded, with one line naming the limit, before anything is
allocated (in-process CLI on the tiny Llama engine; each case answers in well under a second)."""

from __future__ import annotations

import time

import pytest

from enginesmith import cli
from enginesmith.cli import bounds


def refused(capfd, argv: list[str], *words: str) -> str:
    """The CLI's answer to argv is exit 2 and one `error: ... (fix: ...)` line holding `words`."""
    capfd.readouterr()
    start = time.monotonic()
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse refused the value
        code = exc.code
    err = capfd.readouterr().err.strip()
    assert code == 2, err
    assert time.monotonic() - start < 20, "a refusal must come before the work"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(fix: " in lines[0], err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def engine(tiny_engine) -> str:
    return str(tiny_engine("llama"))


@pytest.mark.parametrize("flags, words", [
    (["--threads", "5000"], [f"outside 0..{2 * bounds.cores()}", "cores"]),
    (["--threads", "-1"], ["outside 0.."]),
    (["--gpu-memory-utilization", "nan"], ["(0, 1]"]),
    (["--gpu-memory-utilization", "-1"], ["(0, 1]"]),
    (["--gpu-memory-utilization", "5"], ["(0, 1]"]),
    (["--gpu-memory-utilization", "inf"], ["(0, 1]"]),
    (["--gpu-memory-utilization", "0"], ["(0, 1]"]),
])
def test_run_numbers(engine, capfd, flags, words):
    refused(capfd, ["run", "--engine", engine, *flags, "hi", "--max-tokens", "1"], *words)


def test_empty_engine_and_model_are_errors_not_the_default(capfd):
    refused(capfd, ["run", "--engine", "", "hi"], "--engine", "is empty")
    refused(capfd, ["run", "--model", "", "hi"], "--model", "is empty")
    refused(capfd, ["bench", "--engine", " "], "--engine", "is empty")


@pytest.mark.parametrize("key", ["", " ", "a b", "a\nb", "\x00"])
def test_serve_refuses_an_empty_or_odd_api_key(capfd, key):
    refused(capfd, ["serve", "--model", "tiny:llama", "--api-key", key], "--api-key", "non-empty")


@pytest.mark.parametrize("flags, words", [
    (["--prompt-tokens", "-1"], ["--prompt-tokens -1 is not a positive number"]),
    (["--new-tokens", "0"], ["--new-tokens 0 is not a positive number"]),
    (["--batch", "-1"], ["--batch -1 is not a positive number"]),
    (["--batch", "0"], ["--batch 0"]),
    (["--repeats", "0"], ["--repeats 0"]),
    (["--batch", "1000000"], ["--batch 1000000 needs about", "MiB", "available RAM"]),
])
def test_bench_numbers(engine, capfd, flags, words):
    refused(capfd, ["bench", "--engine", engine, "--device", "cpu", *flags], *words)


def test_bench_pool_bound_before_allocation(paged_engine, capfd):
    refused(capfd, ["bench", "--engine", str(paged_engine), "--device", "cpu", "--requests", "2",
                    "--num-pages", "1000000000"], "--num-pages 1000000000 needs about", "available RAM")


def test_a_batch_that_fits_still_runs(engine, capfd):
    capfd.readouterr()
    assert cli.main(["bench", "--engine", engine, "--device", "cpu", "--batch", "2", "--prompt-tokens", "8",
                     "--new-tokens", "2", "--repeats", "1", "--json"]) == 0


def test_the_memory_estimate_is_the_kv_and_logits(tiny_engine):
    from enginesmith.core import engine_dir

    manifest = engine_dir.read_manifest(tiny_engine("llama"))
    m = manifest.model
    assert bounds.kv_bytes_per_token(manifest) == 2 * m.layers * m.kv_heads * m.head_dim * 4  # fp32
    free, where = bounds.available_bytes("cpu")
    assert where == "available RAM" and free is not None and free > 0
