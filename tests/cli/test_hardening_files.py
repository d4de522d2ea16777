"""Issue 28, part A: nothing a user owns is overwritten or deleted, and where a verb writes is checked
before any work. Each reproduction runs the CLI in-process (enginesmith.cli.main) on tiny engines.

- `export --out X`: X reads X.data (the rename used to leave it pointing at `.X.tmp.data`); an existing
  X, X.data, a folder or a device is refused (`--force` replaces only regular files).
- `build --force` and `triton --copy-engine --force` replace only the files enginesmith wrote; a
  directory whose build.json has no graph (two keys) is no engine.
- `--out ''`, '.', '/', a file's child, a 300-character name; `triton --out FILE`; `--plot` in a missing
  folder: exit 2, one line.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from enginesmith import cli

LONG = "a" * 300


def one_line_error(capfd, code: int, argv: list[str], *words: str) -> str:
    capfd.readouterr()
    got = cli.main(argv)
    err = capfd.readouterr().err.strip()
    assert got == code, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(fix: " in lines[0], err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def temp_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name or p.name.endswith(".lock"))


# ----------------------------------------------------------------------------- export

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One real export of tiny:llama to <tmp>/out/model.onnx (about 15 s)."""
    folder = tmp_path_factory.mktemp("export") / "out"
    assert cli.main(["export", "--model", "tiny:llama", "--out", str(folder / "model.onnx")]) == 0
    return folder / "model.onnx"


def test_export_graph_reads_its_final_data_file(exported, tmp_path, monkeypatch):
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(exported), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}
    assert temp_leftovers(exported.parent) == []
    monkeypatch.chdir(tmp_path)  # ONNX Runtime resolves the data beside the graph, from anywhere
    ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])


def test_export_refuses_what_is_there(exported, tmp_path, capfd):
    before = exported.read_bytes()
    one_line_error(capfd, 2, ["export", "--model", "tiny:llama", "--out", str(exported)], "already exists", "--force")
    assert exported.read_bytes() == before
    lone = tmp_path / "mine.onnx"
    (tmp_path / "mine.onnx.data").write_text("a user's file")  # only the .data name is taken
    one_line_error(capfd, 2, ["export", "--model", "tiny:llama", "--out", str(lone)], "mine.onnx.data", "--force")
    assert (tmp_path / "mine.onnx.data").read_text() == "a user's file" and not lone.exists()


@pytest.mark.parametrize("out, words", [
    ("/dev/null", ["is a device"]),
    ("{tmp}", ["is a folder"]),
    ("", ["is empty"]),
    (".", ["names no file"]),
    ("/", ["names no file"]),
    ("{tmp}/afile/child.onnx", ["is a file, not a folder"]),
    ("{tmp}/" + LONG, ["300 bytes", "at most"]),
])
def test_export_refuses_bad_outputs_before_work(tmp_path, capfd, out, words):
    (tmp_path / "afile").write_text("x")
    for force in ([], ["--force"]):
        one_line_error(capfd, 2, ["export", "--model", "tiny:llama", "--out", out.format(tmp=tmp_path), *force], *words)
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# ----------------------------------------------------------------------------- build / triton --force

@pytest.fixture
def engine_copy(tiny_engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), dst)
    return dst


def test_build_force_keeps_a_users_file(engine_copy, capfd):
    (engine_copy / "my_notes.txt").write_text("do not delete")
    (engine_copy / "tokenizer" / "extra").mkdir()
    before = sorted(p.relative_to(engine_copy).as_posix() for p in engine_copy.rglob("*"))
    one_line_error(capfd, 2, ["build", "--model", "tiny:llama", "--out", str(engine_copy), "--force"],
                   "my_notes.txt", "tokenizer/extra/", "replaces only what enginesmith wrote")
    assert sorted(p.relative_to(engine_copy).as_posix() for p in engine_copy.rglob("*")) == before


def test_a_two_key_build_json_is_no_engine(tmp_path, capfd):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "build.json").write_text(json.dumps({"format_version": 2, "files": {}}))
    one_line_error(capfd, 2, ["build", "--model", "tiny:llama", "--out", str(fake), "--force"],
                   "is not an enginesmith engine")
    assert (fake / "build.json").exists()


@pytest.mark.parametrize("out, words", [
    ("", ["is empty"]), (".", ["names no folder"]), ("/", ["names no folder"]),
    ("{tmp}/afile/child", ["is a file, not a folder"]), ("{tmp}/" + LONG, ["300 bytes"]),
    ("{tmp}/afile", ["is a file"]),
])
def test_build_refuses_bad_outputs(tmp_path, capfd, out, words):
    (tmp_path / "afile").write_text("x")
    one_line_error(capfd, 2, ["build", "--model", "tiny:llama", "--out", out.format(tmp=tmp_path)], *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_triton_force_keeps_files_beside_the_model(tiny_engine, tmp_path, capfd):
    repo = tmp_path / "repo"
    args = ["triton", "--engine", str(tiny_engine("llama")), "--out", str(repo), "--copy-engine"]
    assert cli.main(args) == 0
    (repo / "enginesmith" / "notes.txt").write_text("mine")
    (repo / "enginesmith" / "1" / "engine" / "extra.bin").write_bytes(b"mine")
    one_line_error(capfd, 2, args + ["--force"], "notes.txt", "1/engine/extra.bin")
    assert (repo / "enginesmith" / "notes.txt").read_text() == "mine"
    (repo / "enginesmith" / "notes.txt").unlink()
    (repo / "enginesmith" / "1" / "engine" / "extra.bin").unlink()
    capfd.readouterr()
    assert cli.main(args + ["--force"]) == 0  # only our files: replaced


@pytest.mark.parametrize("argv, words", [
    (["--out", "{tmp}/afile"], ["is a file"]), (["--out", ""], ["is empty"]),
    (["--out", "{tmp}/" + LONG], ["300 bytes"]), (["--out", "{tmp}/repo", "--name", "a\nb"], ["invalid --name"]),
    (["--out", "{tmp}/repo", "--name", "x" * 300], ["invalid --name"]),
])
def test_triton_refuses_bad_outputs(tiny_engine, tmp_path, capfd, argv, words):
    (tmp_path / "afile").write_text("x")
    argv = [a.format(tmp=tmp_path) for a in argv]
    one_line_error(capfd, 2, ["triton", "--engine", str(tiny_engine("llama")), *argv], *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# ----------------------------------------------------------------------------- inputs that were exit 1

def test_unreadable_texts_are_one_line(tiny_engine, tmp_path, capfd):
    engine = str(tiny_engine("llama"))
    one_line_error(capfd, 2, ["eval", "ppl", "--engine", engine, "--text", "/proc/self/mem"], "cannot be read")
    one_line_error(capfd, 2, ["build", "--model", "tiny:llama", "--quant", "w8a8-naive", "--calib-text",
                              "/proc/self/mem", "--out", str(tmp_path / "q")], "cannot be read")
    assert not (tmp_path / "q").exists()


def test_plot_in_a_missing_folder(tmp_path, capfd):
    one_line_error(capfd, 2, ["eval", "ppl", "--model", "tiny:llama", "--kv", "dense", "--tokens", "64", "--window",
                              "32", "--plot", str(tmp_path / "missing" / "p.png")], "folder does not exist")


@pytest.mark.parametrize("graph", ["tokenizer/tokenizer_config.json", "tokenizer/chat_template.jinja"])
def test_a_json_graph_name_in_build_json(engine_copy, capfd, graph):
    from helpers.tamper import resign

    manifest = json.loads((engine_copy / "build.json").read_text())
    manifest["graph"] = graph
    (engine_copy / "build.json").write_text(json.dumps(manifest))
    resign(engine_copy)
    one_line_error(capfd, 3, ["run", "--engine", str(engine_copy), "--raw", "hi", "--max-tokens", "1"],
                   "is not a valid ONNX model")
