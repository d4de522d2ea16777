"""A fuzz test over the CLI's verbs and flags (issue 28): whatever values hypothesis draws, `enginesmith`
ends with exit 0, 2 or 3 (never 1, an internal error, or a traceback), a failure is one line
`error: ... (fix: ...)`, and nothing is written outside `--out` (or the engine cache): the test's arena
(the working directory, a user's files and folders, the engines given as input) is compared entry by
entry before and after every call, and no temp or lock file may remain.

Hypothesis draws a verb, then a subset of its flags, each with a value from hostile edges (negative,
zero, huge, NaN, empty, control characters, devices, /proc files, a file's child, a 300-byte name) and
ordinary ones. `derandomize=True`: every CI run draws the same inputs, no example database. Values are
edges, not ranges, so an accepted input is a small one (the tiny engine; at most a few tokens). `serve`
and `chat` are left out: a valid draw would serve or read stdin forever.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
from pathlib import Path

import pytest

from helpers.external import require_module

hypothesis = require_module("hypothesis", "pip install -e '.[test]' (hypothesis is a test extra)")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from enginesmith import cli  # noqa: E402

EXAMPLES = {"export": 40, "build": 60, "triton": 40, "run": 80, "bench": 60, "eval": 40}
SECONDS_PER_CASE = 90
INPUTS: list[int] = []  # one entry per example run, for the count printed at the end

INTS = ["-1", "0", "1", "2", "3", "4097", str(2 ** 31), str(2 ** 63), "1e3", "", "x", "-0"]
FLOATS = ["0", "-1", "1e-39", "5e-324", "0.5", "1", "5", "nan", "inf", "-inf", "1e400", "", "x"]
TEXTS = ["", " ", "a\nb", "\x01", "ok", "tiny:llama", "x" * 300, "\udcff"]


def fuzz(examples: int):
    # no shrinking: a failing input is reported as drawn (shrinking re-runs builds for minutes)
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def arena(tmp_path_factory, tiny_engine, paged_engine):
    """<arena>/cwd (the working directory), a user's file and folder, a text file, the engines as inputs."""
    root = tmp_path_factory.mktemp("cli-fuzz")
    (root / "cwd").mkdir()
    (root / "afile").write_text("a user's file")
    (root / "notes").mkdir()
    (root / "notes" / "thesis.tex").write_text("years of work")
    (root / "text.txt").write_text("It is a truth universally acknowledged, that a single man. " * 40)
    shutil.copytree(tiny_engine("llama"), root / "engine")
    shutil.copytree(paged_engine, root / "paged")
    yield root
    print(f"\nCLI fuzz: {sum(INPUTS)} inputs")


def outs(root: Path):
    return st.sampled_from(["", ".", "/", "/dev/null", "/proc/self/x", str(root / "afile"), str(root / "notes"),
                            str(root / "afile" / "child"), str(root / ("n" * 300)), str(root / "engine"),
                            str(root / "new"), str(root / "new"), "rel-out"])


def inputs(root: Path):
    return st.sampled_from(["", "/proc/self/mem", "/dev/zero", "/etc/passwd", str(root / "text.txt"),
                            str(root / "missing.txt"), str(root / "notes"), str(root / "afile" / "x")])


def flag_table(root: Path) -> dict:
    ints, floats, texts = st.sampled_from(INTS), st.sampled_from(FLOATS), st.sampled_from(TEXTS)
    engines = st.sampled_from(["", str(root / "engine"), str(root / "paged"), str(root / "notes"), "/dev/null"])
    model = {"--threads": ints, "--gpu-memory-utilization": floats, "--device": st.sampled_from(["cpu", "gpu"])}
    sampling = {"--max-tokens": ints, "--temperature": floats, "--top-p": floats, "--top-k": ints,
                "--repetition-penalty": floats, "--seed": ints, "--stop": texts, "--system": texts}
    build = {"--dtype": st.sampled_from(["fp32", "fp16", "int3"]), "--kv": st.sampled_from(["dense", "paged", "x"]),
             "--page-size": ints, "--sinks": ints, "--kv-window": ints, "--kv-budget": ints, "--force": None,
             "--calib-text": inputs(root), "--calib-samples": ints, "--opset": ints,
             "--quant": st.sampled_from(["w8a8-naive", "w4a16-rtn", "nope"]), "--block-size": ints,
             "--passes": texts, "--lora": inputs(root), "--max-batch": ints, "--capacity": ints}
    return {
        # --model always: without it the default SmolLM2 would be exported (minutes)
        "export": ({"--out": outs(root), "--model": st.sampled_from(["tiny:llama", "tiny:llama", "", "x"])},
                   {"--dtype": st.sampled_from(["fp32", "fp16", "x"]), "--opset": ints, "--force": None}),
        "build": ({"--out": outs(root), "--model": st.sampled_from(["tiny:llama", "tiny:llama", "", "tiny:nope"])},
                  build),
        "triton": ({"--engine": engines, "--out": outs(root)},
                   {"--name": texts, "--copy-engine": None, "--force": None, "--threads": ints, "--workers": ints,
                    "--max-batch": ints, "--num-pages": ints, "--max-waiting": ints, "--max-tokens": ints,
                    "--gpus": texts, "--env": inputs(root)}),
        "run": ({"--engine": engines}, {**model, **sampling, "--raw": None, "--kv": st.sampled_from(["ring", "x"]),
                                        "--speculative": st.sampled_from(["ngram", "x", "draft:"]), "--k": ints}),
        "bench": ({"--engine": engines}, {**model, "--prompt-tokens": ints, "--new-tokens": ints, "--batch": ints,
                                          "--repeats": ints, "--requests": ints, "--num-pages": ints,
                                          "--concurrency": texts, "--chunk": ints, "--png": outs(root),
                                          "--json": None}),
        "eval": ({"--engine": engines}, {**model, "--text": inputs(root), "--tokens": ints, "--window": ints,
                                         "--json": None, "--plot": outs(root)}),
    }


def snapshot(root: Path, skip: set[Path]) -> dict:
    """{relative path: (kind, size, mtime)} of everything under root but the paths in `skip` (and below)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for name in dirnames + filenames:
            p = here / name
            if p in skip:
                continue
            st_ = os.lstat(p)
            found[p.relative_to(root).as_posix()] = (stat.S_IFMT(st_.st_mode), st_.st_size if not name in dirnames
                                                     else 0, st_.st_mtime_ns if name in filenames else 0)
    return found


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def allowed_outputs(root: Path, verb: str, argv: list[str]) -> set[Path]:
    """What a call may write: its --out (+ .data for export; for triton the model folder <out>/<name>),
    --png / --plot. A user's folder (notes) and the text file are never among them."""
    skip = set()
    for flag in ("--out", "--png", "--plot"):
        given = _arg(argv, flag)
        if not given or not given.strip():
            continue
        out = Path(given) if os.path.isabs(given) else root / "cwd" / given
        if verb == "triton" and flag == "--out":
            skip.add(out / (_arg(argv, "--name") or "enginesmith"))
            if not os.path.lexists(out):
                skip.add(out)
        else:
            skip |= {out, Path(f"{out}.data")}
    return skip - {root / "notes", root / "text.txt"}


def reset(root: Path, skip: set[Path]) -> None:
    """Put the arena back after an allowed write: the user's file, new outputs, models written into folders."""
    for p in skip:
        if p in {root / n for n in ("engine", "paged", "cwd", "notes", "text.txt")} or not os.path.lexists(p):
            continue
        if p.is_dir() and not p.is_symlink() and p.parent != Path("/"):
            shutil.rmtree(p)
        elif p.is_file() or p.is_symlink():
            p.unlink()
    (root / "afile").write_text("a user's file")
    for p in (root / "cwd").iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


class _Timeout(BaseException):  # not an Exception: the CLI must not report it as its own error
    pass


def _alarm(signum, frame):
    raise _Timeout()


def call(capfd, argv: list[str]) -> tuple[int, str]:
    capfd.readouterr()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_CASE)
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse refused a value: exit 2
        code = exc.code
    except _Timeout:
        pytest.fail(f"no answer within {SECONDS_PER_CASE} s: {argv}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, capfd.readouterr().err.strip()


def check_verb(verb: str, arena: Path, capfd, monkeypatch, data) -> None:
    required, optional = flag_table(arena)[verb]
    argv = ["eval", "ppl"] if verb == "eval" else [verb]
    for flag, values in required.items():
        argv += [flag, data.draw(values, label=flag)]
    chosen = data.draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True), label="flags")
    for flag in chosen:
        argv += [flag] if optional[flag] is None else [flag, data.draw(optional[flag], label=flag)]
    if verb == "run":
        argv += ["--max-tokens", "2", data.draw(st.sampled_from(["hi", "\udcff", "<|im_start|>", " "]), label="prompt")]
    if verb == "bench" and "--requests" not in chosen:
        argv += ["--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1"] if not any(
            f in chosen for f in ("--prompt-tokens", "--new-tokens", "--repeats")) else []
    if verb == "eval" and "--text" not in chosen:  # a short text: the corpus in windows of 1 would take minutes
        argv += ["--text", str(arena / "text.txt")]
    monkeypatch.chdir(arena / "cwd")
    skip = allowed_outputs(arena, verb, argv)
    before = snapshot(arena, skip)
    code, err = call(capfd, argv)
    INPUTS.append(1)
    assert code in (0, 2, 3), (argv, code, err)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    if code != 0:
        last = err.splitlines()[-1] if err else ""
        assert last.startswith("error: ") and "(fix: " in last, (argv, err)
    after = snapshot(arena, skip)
    assert after == before, (argv, sorted(set(after.items()) ^ set(before.items()))[:6])
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    reset(arena, skip)


@pytest.mark.parametrize("verb", list(EXAMPLES))
def test_cli_fuzz(verb, arena, capfd, monkeypatch):
    @fuzz(EXAMPLES[verb])
    @given(data=st.data())
    def one(data):
        check_verb(verb, arena, capfd, monkeypatch, data)

    one()
