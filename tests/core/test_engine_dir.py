"""The engine directory is a trust boundary: each attack or careless edit of issue 17 ends in one
line and exit 2/3, and no file outside the directory is opened.

Cases run `enginesmith.cli.main` in-process on a copy of the tiny Llama engine (a subprocess only
where a signal or a second process is the point). An audit hook (tests/helpers/audit_opens.py) records
every file this process opens, so "the outside file was never read" is observed, not assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from helpers.audit_opens import opened_under
from helpers.tamper import resign

from enginesmith import cli
from enginesmith.core import engine_dir

@pytest.fixture
def engine(tiny_engine, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), dst)
    return dst


def run_cli(capfd, *args: str) -> tuple[int, str]:
    capfd.readouterr()
    code = cli.main(list(args))
    err = capfd.readouterr().err.strip()
    return code, err


def one_line(code: int, err: str, want_code: int, *words: str) -> str:
    assert code == want_code, (code, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(fix: " in lines[0], err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def run_engine(capfd, path: Path) -> tuple[int, str]:
    return run_cli(capfd, "run", "--engine", str(path), "--raw", "hello", "--max-tokens", "1", "--device", "cpu")


def read(path: Path) -> dict:
    return json.loads((path / "build.json").read_text())


def write_raw(path: Path, manifest) -> None:
    (path / "build.json").write_text(json.dumps(manifest))


# ----------------------------------------------------------------------------- security and data loss

def test_the_copy_runs_and_the_audit_hook_sees_its_reads(engine, capfd):
    """The positive control of every "never opened" assertion below."""
    result = []
    touched = opened_under(engine, lambda: result.append(run_engine(capfd, engine)))
    assert result[0][0] == 0, result[0][1]
    assert str(engine / "build.json") in touched and str(engine / "model.onnx.data") in touched


@pytest.mark.parametrize("graph", ["/ABS/model.onnx", "../other/model.onnx", "/dev/zero", "/etc/passwd",
                                   "./model.onnx", "tokenizer/../model.onnx"])
def test_graph_outside_the_directory_is_refused(engine, tiny_engine, capfd, tmp_path, graph):
    other = tmp_path / "other"
    shutil.copytree(tiny_engine("llama"), other)
    graph = graph.replace("/ABS", str(other))
    m = read(engine)
    m["graph"] = graph
    m["files"][graph] = m["files"]["model.onnx"]
    write_raw(engine, m)
    touched = opened_under(other, lambda: one_line(*run_engine(capfd, engine), 3, "graph" if graph.startswith(
        ("/", "..", "./", "tokenizer")) else "", "relative path"))
    assert touched == []


def test_manifest_paths_outside_are_refused_without_reading_them(engine, capfd, tmp_path):
    """No oracle on outside files: a listed absolute or '..' path is refused before it is opened."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    for rel in (str(secret), "../secret.txt"):
        m = read(engine)
        m["files"][rel] = {"sha256": engine_dir.sha256(secret), "size": secret.stat().st_size}
        write_raw(engine, m)
        touched = opened_under(tmp_path / "secret.txt", lambda: one_line(*run_engine(capfd, engine), 3,
                                                                         "relative path"))
        assert touched == []


def test_unlisted_symlink_to_outside_directory_is_refused(engine, capfd, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "private.key").write_text("key")
    (engine / "extra").symlink_to(outside, target_is_directory=True)
    one_line(*run_engine(capfd, engine), 3, "symbolic link", "extra")
    repo = tmp_path / "repo"
    code, err = run_cli(capfd, "triton", "--engine", str(engine), "--out", str(repo), "--copy-engine")
    one_line(code, err, 3, "symbolic link")
    assert not any(p.name == "private.key" for p in repo.rglob("*")) if repo.exists() else True


@pytest.mark.parametrize("what", ["model.onnx", "tokenizer", "dangling", "fifo"])
def test_links_and_special_files_are_refused(engine, capfd, tmp_path, what):
    if what == "model.onnx":  # the real graph moved out, a link left in its place
        shutil.move(engine / "model.onnx", tmp_path / "model.onnx")
        (engine / "model.onnx").symlink_to(tmp_path / "model.onnx")
    elif what == "tokenizer":
        shutil.move(engine / "tokenizer", tmp_path / "tokenizer")
        (engine / "tokenizer").symlink_to(tmp_path / "tokenizer", target_is_directory=True)
    elif what == "dangling":
        (engine / "gone").symlink_to(tmp_path / "nothing-here")
    else:
        os.mkfifo(engine / "tokenizer" / "pipe")
    start = time.monotonic()
    line = one_line(*run_engine(capfd, engine), 3)
    assert "symbolic link" in line or "not a regular file" in line, line
    assert time.monotonic() - start < 30  # a FIFO is never opened (it would block)


def test_oversized_or_special_build_json_is_refused(engine, capfd):
    (engine / "build.json").write_bytes(b" " * (engine_dir.MAX_MANIFEST_BYTES + 1))
    one_line(*run_engine(capfd, engine), 3, "more than a build.json holds")
    (engine / "build.json").unlink()
    os.mkfifo(engine / "build.json")
    one_line(*run_engine(capfd, engine), 3, "not a regular file")


def test_sizes_are_checked_before_hashes(engine, capfd):
    with open(engine / "model.onnx.data", "ab") as f:
        f.write(b"\0" * 4096)
    touched = opened_under(engine / "model.onnx.data", lambda: one_line(*run_engine(capfd, engine), 3, "bytes"))
    assert touched == []  # refused by its size, never opened


def test_force_replaces_only_an_engine(tmp_path, capfd):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    code, err = run_cli(capfd, "build", "--model", "tiny:llama", "--out", str(notes), "--force")
    one_line(code, err, 2, "is not an enginesmith engine", "--force replaces only")
    assert (notes / "thesis.tex").read_text() == "years of work"
    plain = tmp_path / "file.txt"
    plain.write_text("keep")
    code, err = run_cli(capfd, "build", "--model", "tiny:llama", "--out", str(plain), "--force")
    one_line(code, err, 2, "not a directory")
    assert plain.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "notes"]  # no .old-PID, no temp dir


def test_a_second_build_to_the_same_out_fails_fast(tmp_path):
    """A real second process holds the lock while the CLI tries to build the same --out."""
    out = tmp_path / "engine"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from enginesmith.core import engine_dir\n"
        f"with engine_dir.lock(engine_dir.Path({str(out)!r}), wait=False):\n"
        "    print('locked', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "enginesmith.cli", "build", "--model", "tiny:llama",
                                 "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: another build is writing {out}")
        assert time.monotonic() - start < 60
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()


def test_stale_temp_dirs_of_dead_builds_are_removed(tmp_path):
    target = tmp_path / "engine"
    stale = [tmp_path / ".engine.tmp-999999-abc", tmp_path / ".engine.old-999999"]
    for d in stale:
        d.mkdir()
        (d / "model.onnx.data").write_bytes(b"\0" * 1024)
    (tmp_path / ".other.tmp-1-x").mkdir()  # another target's: not ours to remove
    with engine_dir.write_atomically(target) as tmp:
        (tmp / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1-x", "engine"]


def test_out_under_proc_is_one_line(capfd):
    code, err = run_cli(capfd, "build", "--model", "tiny:llama", "--out", "/proc/foo")
    one_line(code, err, 2, "cannot write foo in /proc")


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs (needs root and mount, as on this project's machines and CI), unmounted after."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}): full/read-only disks untested")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_out_on_a_full_or_read_only_filesystem_is_one_line(small_fs):
    result = subprocess.run([sys.executable, "-m", "enginesmith.cli", "build", "--model", "tiny:llama", "--out",
                             str(small_fs / "e")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write e in {small_fs}: no space is left on the device"), last
    assert os.listdir(small_fs) == []  # the partial export was removed
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    result = subprocess.run([sys.executable, "-m", "enginesmith.cli", "build", "--model", "tiny:llama", "--out",
                             str(small_fs / "e")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "the file system is read-only" in result.stderr.strip().splitlines()[-1], \
        result.stderr


# ----------------------------------------------------------------------------- wrong JSON types

BAD_MANIFESTS = {
    "a list": [],
    "a number": 1,
    "model null": lambda m: m.update(model=None),
    "files a list": lambda m: m.update(files=list(m["files"])),
    "backend [1]": lambda m: m.update(backend=[1]),
    "kv_layout a string": lambda m: m.update(kv_layout="ring"),
    "graph missing": lambda m: m.pop("graph"),
    "graph 5": lambda m: m.update(graph=5),
    "max_positions lots": lambda m: m["model"].update(max_positions="lots"),
    "eos ids": lambda m: m["model"].update(eos_token_ids=["x", None]),
    "format_version string": lambda m: m.update(format_version="1"),
    "format 1": lambda m: m.update(format_version=1),
    "ring without window": lambda m: m.update(kv_layout={"type": "ring", "sinks": 4}),
    "size negative": lambda m: m["files"]["model.onnx"].update(size=-1),
    "sha short": lambda m: m["files"]["model.onnx"].update(sha256="abc"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_wrong_json_types_are_one_line(engine, capfd, case):
    change = BAD_MANIFESTS[case]
    if callable(change):
        m = read(engine)
        change(m)
    else:
        m = change
    write_raw(engine, m)
    line = one_line(*run_engine(capfd, engine), 3)
    assert "build.json" in line


def test_invalid_utf8_build_json(engine, capfd):
    (engine / "build.json").write_bytes(b'{"graph": "\xff\xfe"}')
    one_line(*run_engine(capfd, engine), 3, "not UTF-8")


def test_garbage_graph_with_matching_hash_is_one_line(engine, capfd):
    shutil.copy(Path("/etc/passwd"), engine / "model.onnx")
    resign(engine, read(engine))
    one_line(*run_engine(capfd, engine), 3, "not a valid ONNX model")


# ----------------------------------------------------------------------------- messages

def test_engine_that_is_a_file_says_so(capfd, tmp_path):
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0")
    one_line(*run_engine(capfd, f), 3, "is a file, not an engine directory")


def test_string_format_version_says_what_is_wrong(engine, capfd):
    m = read(engine)
    m["format_version"] = "1"
    write_raw(engine, m)
    line = one_line(*run_engine(capfd, engine), 3, "format_version", "must be an integer", "'1'")
    assert "reads 1" not in line
    m["format_version"] = 1
    write_raw(engine, m)
    line = one_line(*run_engine(capfd, engine), 3, "engine format 1", "(2)", "enginesmith build --model tiny:llama")


def test_external_data_escaping_the_directory(engine, capfd, tmp_path):
    shutil.copy(engine / "model.onnx.data", tmp_path / "outside.data")
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../outside.data"
    onnx.save(model, str(engine / "model.onnx"))
    resign(engine, read(engine))
    touched = opened_under(tmp_path / "outside.data", lambda: one_line(
        *run_engine(capfd, engine), 3, "which is not a file of the engine directory"))
    assert touched == []


def test_cached_engine_fix_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path))
    cached = tmp_path / "engines" / "abc"
    assert "rm -r" in engine_dir.rebuild_fix(cached) and "rebuilt on the next run" in engine_dir.rebuild_fix(cached)
    other = engine_dir.rebuild_fix(tmp_path / "mine", {"source": {"path": "tiny:llama"}})
    assert other == f"rebuild it: enginesmith build --model tiny:llama --out {tmp_path / 'mine'} --force"
