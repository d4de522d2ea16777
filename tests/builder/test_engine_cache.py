"""The engine cache hands out only engines written by this code: an entry whose build.json names other
builder code (an upgrade that changed the export or a pass) is rebuilt, with a notice."""

from __future__ import annotations

import json
import sys

from enginesmith.builder import code_fingerprint as fp
from enginesmith.builder.engine import BuildConfig, cached_engine


def test_an_engine_cached_by_other_code_is_rebuilt(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))
    config = BuildConfig(model="tiny:llama")
    path = cached_engine(config, progress=False)
    manifest = json.loads((path / "build.json").read_text())
    assert manifest["builder_code"] == fp.code_fingerprint()
    capfd.readouterr()
    assert cached_engine(config, progress=False) == path  # this code's entry: reused, no notice
    assert "notice" not in capfd.readouterr().err

    manifest["builder_code"] = "0" * 16  # as an older enginesmith would have left it
    (path / "build.json").write_text(json.dumps(manifest))
    assert cached_engine(config, progress=False) == path
    assert "was built by other enginesmith code; rebuilding it" in capfd.readouterr().err
    assert json.loads((path / "build.json").read_text())["builder_code"] == fp.code_fingerprint()

    del manifest["builder_code"]  # from before the fingerprint existed
    (path / "build.json").write_text(json.dumps(manifest))
    cached_engine(config, progress=False)
    assert "rebuilding it" in capfd.readouterr().err


def test_the_fingerprint_covers_every_source_file(tmp_path, monkeypatch):
    package = tmp_path / "fp_probe"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "graph.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(fp, "PACKAGES", ("fp_probe",))
    fp.code_fingerprint.cache_clear()
    try:
        before = fp.code_fingerprint()
        (package / "sub" / "graph.py").write_text("X = 2\n")  # a nested module's bytes
        fp.code_fingerprint.cache_clear()
        edited = fp.code_fingerprint()
        (package / "sub" / "extra.py").write_text("")  # a new module
        fp.code_fingerprint.cache_clear()
        assert len({before, edited, fp.code_fingerprint()}) == 3
    finally:
        sys.modules.pop("fp_probe", None)
        fp.code_fingerprint.cache_clear()
