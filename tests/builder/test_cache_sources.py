"""Issue 28, part A: a pass build's cached source engine is verified against its recorded sha256s
before use (a corrupted entry is rebuilt with a notice, never passed on), and the cache key holds only
what changes the engine."""

from __future__ import annotations

import pytest

from enginesmith.builder.engine import BuildConfig, build, cached_engine
from enginesmith.core import engine_dir


def test_a_corrupted_plain_engine_is_rebuilt_before_a_pass_build(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))
    plain = cached_engine(BuildConfig(model="tiny:llama"), progress=False)
    data = plain / "model.onnx.data"
    good = data.read_bytes()
    corrupted = bytearray(good)
    corrupted[1024:1024 + 256] = bytes(256)  # same size: only the hash tells
    data.write_bytes(bytes(corrupted))
    capfd.readouterr()
    out = build(BuildConfig(model="tiny:llama", kv_layout="paged"), tmp_path / "paged", progress=False)
    err = capfd.readouterr().err
    assert "notice: the cached engine" in err and "sha256 mismatch" in err and "rebuilding it" in err
    assert data.read_bytes() == good  # the export is deterministic: the rebuilt source is the original
    engine_dir.verify(plain)
    engine_dir.verify(out)
    capfd.readouterr()
    build(BuildConfig(model="tiny:llama", kv_layout="paged"), tmp_path / "again", progress=False)
    assert "notice" not in capfd.readouterr().err  # an intact source: used as it is


def test_run_refuses_what_the_build_would_have_used(tmp_path, monkeypatch):
    """The plain cached entry opened directly (run) still refuses altered bytes: exit 3 there."""
    from enginesmith.core.errors import EngineError
    from enginesmith.runtime.load import open_engine

    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))
    plain = cached_engine(BuildConfig(model="tiny:llama"), progress=False)
    with open(plain / "model.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    with pytest.raises(EngineError, match="sha256 mismatch"):
        open_engine(plain, device="cpu")


@pytest.mark.parametrize("extra", [
    dict(calib_samples=5), dict(calib_text="/nonexistent.txt"), dict(page_size=32), dict(kv_budget=64),
    dict(kv_sinks=2, kv_window=30), dict(block_size=32), dict(alpha=0.5), dict(accuracy_level=4),
])
def test_options_a_plain_engine_does_not_read_leave_its_key(extra):
    sha = "ab" * 32
    assert BuildConfig(model="tiny:llama", **extra).key(sha) == BuildConfig(model="tiny:llama").key(sha)


def test_the_plain_source_of_pass_builds_is_shared():
    from enginesmith.builder.engine import _plain_source

    sha = "cd" * 32
    configs = [BuildConfig(model="tiny:llama", kv_layout="paged", page_size=8, calib_samples=3),
               BuildConfig(model="tiny:llama", quant="w8a8-naive", calib_samples=7, calib_text="/x.txt"),
               BuildConfig(model="tiny:llama", kv_layout="ring", kv_sinks=2, kv_window=62),
               BuildConfig(model="tiny:llama", quant="w4a16-rtn", block_size=32, accuracy_level=4)]
    keys = {_plain_source(c, c.dtype, c.opset).key(sha) for c in configs}
    assert keys == {BuildConfig(model="tiny:llama").key(sha)}


@pytest.mark.parametrize("a, b", [
    (dict(kv_layout="paged", page_size=16), dict(kv_layout="paged", page_size=32)),
    (dict(kv_layout="ring", kv_window=30), dict(kv_layout="ring", kv_window=62)),
    (dict(quant="w8a8-sq", calib_samples=4), dict(quant="w8a8-sq", calib_samples=8)),
    (dict(quant="w4a16-rtn", block_size=32), dict(quant="w4a16-rtn", block_size=64)),
    (dict(dtype="fp16"), dict()),
])
def test_what_changes_an_engine_changes_its_key(a, b):
    sha = "ef" * 32
    assert BuildConfig(model="tiny:llama", **a).key(sha) != BuildConfig(model="tiny:llama", **b).key(sha)


def test_the_default_engine_keeps_its_key():
    """Keys of engines cached before this change stay (no rebuild of every user's default engine)."""
    import hashlib
    import json

    from enginesmith import __version__

    settings = {"dtype": "fp32", "opset": 23, "passes": [], "backend": "ort"}  # as the keys before issue 28
    want = hashlib.sha256((json.dumps(settings, sort_keys=True) + __version__).encode()).hexdigest()[:12]
    assert BuildConfig().key("00" * 32) == f"{'00' * 8}-{want}"
