"""Issue 17's attacks and careless inputs, each run through the real `enginesmith` command: prints a
markdown table (item, what was done, exit code, the last stderr line). Needs the tiny Llama engine
(built into $ENGINESMITH_CACHE on first use, ~30 s).

    python benchmarks/hardening/attack_table.py > table.md
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from enginesmith.builder import BuildConfig, cached_engine
from enginesmith.core import engine_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attack_28a  # noqa: E402  (issue 28 part A's rows, beside this script)


def cli(*args: str, stdin: str | None = None, timeout: int = 300, env: dict | None = None, all_lines: bool = False,
        stdout: bool = False) -> tuple[int, str]:
    """(exit code, the last stderr line; all of stderr with `all_lines`; stdout with `stdout`), run in a
    scratch working directory."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})}
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-m", "enginesmith.cli", *args], capture_output=True, timeout=timeout,
                           env=env, input=stdin.encode() if stdin else None, cwd=cwd)
    if stdout:
        return r.returncode, r.stdout.decode("utf-8", "replace")
    text = r.stderr.decode("utf-8", "replace").strip()
    lines = text.splitlines()
    return r.returncode, text if all_lines else (lines[-1] if lines else "")


def resign(path: Path) -> None:
    m = json.loads((path / "build.json").read_text())
    m["files"] = {p.relative_to(path).as_posix(): {"sha256": engine_dir.sha256(p), "size": p.stat().st_size}
                  for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != "build.json"}
    (path / "build.json").write_text(json.dumps(m))


def main() -> None:
    pristine = cached_engine(BuildConfig(model="tiny:llama"), progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)

        def fresh(name: str = "e") -> Path:
            dst = tmp / name
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(pristine, dst)
            return dst

        def run_engine(path: Path, *extra: str) -> tuple[int, str]:
            return cli("run", "--engine", str(path), "--raw", "hi", "--max-tokens", "1", *extra)

        def edit(change) -> Path:
            e = fresh()
            m = json.loads((e / "build.json").read_text())
            new = change(m)
            m = m if new is None else new
            (e / "build.json").write_text(json.dumps(m))
            return e

        other = fresh("other")
        rows.append(("1", "build.json graph absolute (another engine's)",
                     *run_engine(edit(lambda m: m.update(graph=str(other / "model.onnx"))))))
        rows.append(("1", "build.json graph ../other/model.onnx", *run_engine(edit(lambda m: m.update(graph="../other/model.onnx")))))
        rows.append(("2", 'graph "/dev/zero"', *run_engine(edit(lambda m: m.update(graph="/dev/zero")))))
        e = fresh()
        (tmp / "outside").mkdir(exist_ok=True)
        (e / "extra").symlink_to(tmp / "outside", target_is_directory=True)
        rows.append(("3", "unlisted symlink to an outside directory: run", *run_engine(e)))
        rows.append(("3", "the same: triton --copy-engine", *cli("triton", "--engine", str(e), "--out", str(tmp / "repo"),
                                                               "--copy-engine")))
        e = fresh()
        shutil.move(e / "model.onnx", tmp / "moved.onnx")
        (e / "model.onnx").symlink_to(tmp / "moved.onnx")
        rows.append(("3", "symlinked model.onnx", *run_engine(e)))
        e = fresh()
        os.mkfifo(e / "tokenizer" / "fifo")
        rows.append(("3", "a FIFO in tokenizer/", *run_engine(e)))
        notes = tmp / "notes"
        notes.mkdir()
        (notes / "thesis.tex").write_text("x")
        rows.append(("4", "build --force --out DIR (not an engine)", *cli("build", "--model", "tiny:llama", "--out",
                                                                          str(notes), "--force")))
        (tmp / "file").write_text("x")
        rows.append(("4", "build --force --out FILE", *cli("build", "--model", "tiny:llama", "--out", str(tmp / "file"),
                                                           "--force")))
        rows.append(("5", 'files {"/etc/passwd": sha}', *run_engine(edit(lambda m: m["files"].update(
            {"/etc/passwd": {"sha256": engine_dir.sha256(Path("/etc/passwd")), "size": 1}})))))
        with engine_dir.lock(tmp / "locked", wait=False):
            rows.append(("6", "second build to an --out being written", *cli("build", "--model", "tiny:llama", "--out",
                                                                             str(tmp / "locked"))))
        for case, change in [("[]", lambda m: []), ("1", lambda m: 1), ('"model": null', lambda m: m.update(model=None)),
                             ('"files" a list', lambda m: m.update(files=list(m["files"]))),
                             ('"backend": [1]', lambda m: m.update(backend=[1])),
                             ('"kv_layout": "ring"', lambda m: m.update(kv_layout="ring")),
                             ('"graph" missing', lambda m: m.pop("graph") and None),
                             ('"graph": 5', lambda m: m.update(graph=5)),
                             ('"max_positions": "lots"', lambda m: m["model"].update(max_positions="lots")),
                             ('"eos_token_ids": ["x", null]', lambda m: m["model"].update(eos_token_ids=["x", None])),
                             ('"graph": "/etc/passwd"', lambda m: m.update(graph="/etc/passwd")),
                             ('"format_version": "1"', lambda m: m.update(format_version="1"))]:
            rows.append(("types", f"build.json {case}", *run_engine(edit(change))))
        e = fresh()
        (e / "build.json").write_bytes(b'{"graph": "\xff"}')
        rows.append(("types", "build.json invalid UTF-8", *run_engine(e)))
        for name, content in [("tokenizer.json", b"{"), ("tokenizer.json", b""), ("tokenizer.json", b"[]"),
                              ("tokenizer_config.json", b"[[["), ("tokenizer_config.json", b"\xff"),
                              ("chat_template.jinja", b"{% if %}"),
                              ("chat_template.jinja", b"{{ ''.__class__.__mro__ }}"),
                              ("chat_template.jinja", b"{{ 'x' * 300000000 }}")]:
            e = fresh()
            (e / "tokenizer" / name).write_bytes(content)
            resign(e)
            args = ("run", "--engine", str(e), "hi", "--max-tokens", "1")
            rows.append(("tokenizer", f"{name} = {content[:30]!r}", *cli(*args)))
        rows.append(("cli", "run $'\\xff\\xfe hello'", *cli("run", os.fsdecode(b"\xff\xfe hello"), "--engine", str(pristine))))
        rows.append(("cli", "run hi --seed -1", *cli("run", "hi", "--seed", "-1")))
        rows.append(("cli", "build --out /proc/foo", *cli("build", "--model", "tiny:llama", "--out", "/proc/foo")))
        bad = tmp / "badmodel"
        bad.mkdir()
        (bad / "config.json").write_bytes(b"\0" * 64)
        rows.append(("model", "--model DIR with a NUL-filled config.json", *cli("build", "--model", str(bad), "--out",
                                                                               str(tmp / "o1"))))
        (bad / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                     "hidden_size": 64, "num_attention_heads": 0,
                                                     "intermediate_size": 128, "num_key_value_heads": 1,
                                                     "num_hidden_layers": 1, "vocab_size": 100}))
        rows.append(("model", "Llama config num_attention_heads: 0", *cli("build", "--model", str(bad), "--out",
                                                                          str(tmp / "o2"))))
        passwd = Path("/etc/passwd")
        rows.append(("msg", "--engine /etc/passwd", *run_engine(passwd)))
        rows.append(("msg", '"format_version": 1 (an older format)', *run_engine(edit(lambda m: m.update(format_version=1)))))
    print("| item | input | exit | stderr (last line) |")
    print("|---|---|---:|---|")
    for item, what, code, line in rows:
        print(f"| {item} | {what.replace('|', '/')} | {code} | {line.replace('|', '/')[:260]} |")
    with tempfile.TemporaryDirectory() as d:  # issue 28, part A: before (as filed) and after
        paged = cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged"), progress=False)
        table = attack_28a.rows(cli, Path(d), pristine, paged)
        print("\n| item | input | before | exit | stderr (last line) |")
        print("|---|---|---|---:|---|")
        for item, what, before, code, line in table:
            line = line.replace(d, "TMP").replace("|", "/")[:260]
            print(f"| {item} | {what.replace('|', '/')} | {before} | {code} | {line} |")


if __name__ == "__main__":
    main()
