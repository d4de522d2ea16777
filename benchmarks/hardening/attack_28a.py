"""Issue 28, part A: the attacks on what the CLI writes, reads and allocates, each run through the real
`enginesmith` command (attack_table.cli). `before` is what the issue (and a reproduction on the tree of
commit 875e3b3) recorded; the exit code and the last stderr line are this tree's.

    python benchmarks/hardening/attack_table.py   # prints issue 17's table, then this one
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

LONG = "a" * 300


def _loads(graph: Path) -> str:
    """Whether ONNX Runtime opens an exported graph from another directory (its data reference)."""
    import onnxruntime as ort

    here = os.getcwd()
    os.chdir("/")
    try:
        ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        return "ONNX Runtime loads it"
    except Exception as exc:  # noqa: BLE001  (the row reports whatever went wrong)
        return f"ONNX Runtime fails: {str(exc)[:80]}"
    finally:
        os.chdir(here)


def rows(cli: Callable[..., tuple[int, str]], tmp: Path, pristine: Path, paged: Path) -> list[tuple]:
    """(item, input, before, exit, last stderr line) per attack."""
    out: list[tuple] = []

    def add(item: str, what: str, before: str, result: tuple[int, str], note: str = "") -> None:
        out.append((item, what, before, result[0], (note + " / " if note else "") + result[1]))

    (tmp / "afile").write_text("x")
    (tmp / "adir").mkdir()
    x = tmp / "x.onnx"
    r = cli("export", "--model", "tiny:llama", "--out", str(x))
    add("1", "export --out X", "0, X reads .X.tmp.data (gone): unloadable", r, _loads(x))
    add("1", "export --out X again (no --force)", "0, X and X.data replaced", cli("export", "--model", "tiny:llama",
                                                                                   "--out", str(x)))
    add("1", "export --out /dev/null --force", "0, /dev/null replaced by a file (as root)",
        cli("export", "--model", "tiny:llama", "--out", "/dev/null", "--force"))
    add("1/6", "export --out DIR", "1 (IsADirectoryError)", cli("export", "--model", "tiny:llama", "--out", str(tmp / "adir")))
    add("6", "export --out ''", "1 (ValueError)", cli("export", "--model", "tiny:llama", "--out", ""))
    out += _cache_rows(cli, tmp, add)
    out += _force_rows(cli, tmp, pristine, add)
    out += _bound_rows(cli, tmp, pristine, paged, add)
    out += _exit1_rows(cli, tmp, pristine, add)
    return out


def _cache_rows(cli, tmp: Path, add) -> list:
    """A corrupted cached plain engine under `build --kv paged`, and the plain engine's key."""
    cache = tmp / "cache"
    env = {"ENGINESMITH_CACHE": str(cache)}
    cli("build", "--model", "tiny:llama", "--kv", "paged", "--out", str(tmp / "p0"), env=env)
    plain = next(p for p in (cache / "engines").iterdir()
                 if p.is_dir() and json.loads((p / "build.json").read_text())["kv_layout"]["type"] == "dense")
    data = plain / "model.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[1024:1024 + 4096] = bytes(4096)
    data.write_bytes(bytes(blob))
    r = cli("build", "--model", "tiny:llama", "--kv", "paged", "--out", str(tmp / "p1"), env=env, all_lines=True)
    at = r[1].find("notice:")  # after a progress bar's carriage returns, not at a line's start
    notice = r[1][at:].splitlines()[0] if at >= 0 else "no notice"
    add("3", "corrupted cached plain engine -> build --kv paged", "0, the new engine has broken weights",
        (r[0], notice[:200]))
    for samples in ("5", "9"):
        cli("build", "--model", "tiny:llama", "--kv", "paged", "--page-size", "32", "--calib-samples", samples,
            "--out", str(tmp / f"p{samples}"), env=env)
    engines = len([p for p in (cache / "engines").iterdir() if p.is_dir()])
    add("8", "build --kv paged (x3: --page-size 32, --calib-samples 5 / 9)", "a plain engine per option set",
        (0, f"engines in the cache: {engines} (the plain one, shared)"))
    return []


def _force_rows(cli, tmp: Path, pristine: Path, add) -> list:
    e = tmp / "e-notes"
    shutil.copytree(pristine, e)
    (e / "my_notes.txt").write_text("mine")
    add("4", "build --force, engine dir + my_notes.txt", "0, my_notes.txt deleted",
        cli("build", "--model", "tiny:llama", "--out", str(e), "--force"))
    two = tmp / "two-key"
    two.mkdir()
    (two / "build.json").write_text('{"format_version": 2, "files": {}}')
    (two / "thesis.tex").write_text("x")
    add("4", "build --force, dir with a two-key build.json", "0, directory deleted",
        cli("build", "--model", "tiny:llama", "--out", str(two), "--force"))
    repo = tmp / "repo"
    cli("triton", "--engine", str(pristine), "--out", str(repo), "--copy-engine")
    (repo / "enginesmith" / "notes.txt").write_text("mine")
    add("4", "triton --copy-engine --force, notes.txt beside the model", "0, notes.txt deleted",
        cli("triton", "--engine", str(pristine), "--out", str(repo), "--copy-engine", "--force"))
    return []


def _bound_rows(cli, tmp: Path, pristine: Path, paged: Path, add) -> list:
    run = ("run", "--engine", str(pristine), "hi", "--max-tokens", "1")
    add("5", "run --threads 5000", "hang, 81 s to die after SIGTERM", cli(*run, "--threads", "5000"))
    add("5", "bench --batch 1000000", "killed by the OOM killer", cli("bench", "--engine", str(pristine),
                                                                      "--batch", "1000000"))
    add("5", "bench --requests 2 --num-pages 1000000000", "1 (MemoryError, 1.86 TiB)",
        cli("bench", "--engine", str(paged), "--requests", "2", "--num-pages", "1000000000"))
    for value in ("nan", "-1", "5"):
        add("9", f"run --gpu-memory-utilization {value}", "0 (accepted)", cli(*run, "--gpu-memory-utilization", value))
    add("9", "triton --name $'a\\nb'", "0 (newline in config.pbtxt)",
        cli("triton", "--engine", str(pristine), "--out", str(tmp / "repo2"), "--name", "a\nb"))
    add("9", "run --engine ''", "0 (built the default model)", cli("run", "--engine", "", "hi"))
    add("9", "serve --api-key ''", "starts with no key", cli("serve", "--engine", str(paged), "--api-key", ""))
    greedy = cli(*run[:3], "--raw", "Once upon", "--max-tokens", "8", stdout=True)
    tiny = cli(*run[:3], "--raw", "Once upon", "--max-tokens", "8", "--temperature", "1e-39", stdout=True)
    add("7", "run --temperature 1e-39", "0, prints nothing (NaN, token 0)",
        (tiny[0], f"same text as greedy: {tiny[1] == greedy[1] and bool(greedy[1].strip())}"))
    return []


def _exit1_rows(cli, tmp: Path, pristine: Path, add) -> list:
    for flag, value in (("--prompt-tokens", "-1"), ("--new-tokens", "0"), ("--batch", "-1")):
        add("6", f"bench {flag} {value}", "1 (internal error)", cli("bench", "--engine", str(pristine), flag, value))
    add("6", "eval ppl --text /proc/self/mem", "1 (OSError EIO)",
        cli("eval", "ppl", "--engine", str(pristine), "--text", "/proc/self/mem"))
    add("6", "build --quant w8a8-naive --calib-text /proc/self/mem", "1 (OSError EIO, after the export)",
        cli("build", "--model", "tiny:llama", "--quant", "w8a8-naive", "--calib-text", "/proc/self/mem", "--out",
            str(tmp / "q")))
    for out in ("", ".", "/", str(tmp / "afile" / "child"), str(tmp / LONG)):
        shown = out.replace(str(tmp), "TMP").replace(LONG, "a*300")
        add("6", f"build --out {shown!r}", "1 (ValueError / OSError)", cli("build", "--model", "tiny:llama", "--out", out))
    add("6", "triton --out FILE", "1 (FileExistsError)", cli("triton", "--engine", str(pristine), "--out",
                                                             str(tmp / "afile")))
    add("6", "triton --out ''", "0, a model written into the working directory",
        cli("triton", "--engine", str(pristine), "--out", ""))
    add("6", "eval ppl --kv dense --plot missing/p.png", "1 (FileNotFoundError, after the run)",
        cli("eval", "ppl", "--model", "tiny:llama", "--kv", "dense", "--tokens", "64", "--window", "32", "--plot",
            str(tmp / "missing" / "p.png")))
    e = tmp / "json-graph"
    shutil.copytree(pristine, e)
    manifest = json.loads((e / "build.json").read_text())
    manifest["graph"] = "tokenizer/tokenizer_config.json"
    (e / "build.json").write_text(json.dumps(manifest))
    add("6", 'build.json "graph": "tokenizer/tokenizer_config.json"', "1 (protobuf ParseError)",
        cli("run", "--engine", str(e), "hi", "--max-tokens", "1"))
    return []
