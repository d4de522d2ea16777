"""One install for GPU users: the ONNX Runtime flavour check, finding the CUDA libraries and compiling
them on first use into the cache (one library at a time, under one lock a key), `enginesmith doctor`,
and the --for-cuda build knobs. The wheels themselves: tests/plugins/test_wheel.py.

Installs are real: site-packages folders with pip's dist-info metadata, the CLI run in processes that
see exactly those folders. The cache's locking and growth run real processes and locks with CMake and
nvcc stood in for (cmake_stand_in.py): the real compile is tested by test_wheel.py's build (nvcc, one
arch) and, on a GPU, by test_first_use_on_a_gpu_compiles_for_it_and_the_engine_runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import onnx
import pytest

from enginesmith import cli
from enginesmith.core import onnxruntime_flavour
from enginesmith.core.errors import UserError
from enginesmith.plugins import compile as plugin_compile
from enginesmith.plugins import ort_ops
from helpers.cmake_stand_in import LAUNCH_CLI, stand_in_run_cmake
from helpers.cli import assert_one_line_error

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers

def fake_dist(site: Path, name: str, version: str, module: bool = True) -> None:
    """What pip leaves in `site` for distribution `name`: its dist-info (METADATA) and, with `module`,
    the onnxruntime package it provides."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if module:
        (site / "onnxruntime").mkdir(exist_ok=True)
        (site / "onnxruntime" / "__init__.py").write_text(f"__version__ = {version!r}\n")


def flavour_probe(*sites: Path) -> dict:
    """check() in a fresh interpreter that sees only `sites` and the repo (no site-packages)."""
    code = ("import json\n"
            "from enginesmith.core import onnxruntime_flavour as f\n"
            "from enginesmith.core.errors import UserError\n"
            "i = f.inspect()\n"
            "out = {'flavour': i.flavour, 'version': i.version, 'notes': list(i.notes)}\n"
            "try:\n"
            "    out['module'] = f.require().__file__\n"
            "except UserError as e:\n"
            "    out['error'] = str(e)\n"
            "print(json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, sites), str(REPO)])}
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def site_without_onnxruntime(dest: Path) -> Path:
    """A site-packages folder of links to this venv's packages, ONNX Runtime left out."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    for entry in purelib.iterdir():
        if entry.name == "onnxruntime" or entry.name.startswith(("onnxruntime-", "onnxruntime_")):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


def cli_in_site(site: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a process whose only site-packages is `site` (its .pth files run: the editable
    install's finder too)."""
    code = ("import site, sys\n"
            f"site.addsitedir({str(site)!r})\n"
            "from enginesmith.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-S", "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=str(site.parent))


# ----------------------------------------------------------------------------- the ONNX Runtime flavour

def test_flavour_is_the_distribution_that_provides_the_module(tmp_path):
    fake_dist(tmp_path / "gpu", "onnxruntime-gpu", "1.31.1")
    r = flavour_probe(tmp_path / "gpu")
    assert r["flavour"] == "cuda" and r["version"] == "1.31.1" and "error" not in r
    assert Path(r["module"]).parent == tmp_path / "gpu" / "onnxruntime"


def test_both_flavours_in_one_site_packages_are_refused_with_the_fix(tmp_path):
    site = tmp_path / "site"
    fake_dist(site, "onnxruntime", "1.31.0")
    fake_dist(site, "onnxruntime-gpu", "1.31.1", module=False)  # pip wrote its files over the same module
    r = flavour_probe(site)
    assert "onnxruntime 1.31.0 and onnxruntime-gpu 1.31.1 are both installed" in r["error"]
    assert onnxruntime_flavour.MIXED_FIX in r["error"] and "module" not in r


def test_a_flavour_shadowed_from_another_sys_path_entry_is_fine(tmp_path):
    """The GPU machine's layout: onnxruntime-gpu in a --target folder on PYTHONPATH, a CPU onnxruntime
    in the system site-packages behind it. The first one is imported; the other is only a note."""
    fake_dist(tmp_path / "target", "onnxruntime-gpu", "1.31.1")
    fake_dist(tmp_path / "system", "onnxruntime", "1.30.0")
    r = flavour_probe(tmp_path / "target", tmp_path / "system")
    assert r["flavour"] == "cuda" and "error" not in r
    assert Path(r["module"]).parent == tmp_path / "target" / "onnxruntime"
    assert len(r["notes"]) == 1 and "onnxruntime 1.30.0" in r["notes"][0] and "shadowed" in r["notes"][0]


def test_no_onnxruntime_is_one_line_at_first_use_and_doctor_still_works(tmp_path):
    site = site_without_onnxruntime(tmp_path / "site")
    env = {"ENGINESMITH_CACHE": str(tmp_path / "cache")}
    built = cli_in_site(site, "build", "--model", "tiny:llama", "--out", str(tmp_path / "e"), env=env)
    assert_one_line_error(built, 2)
    assert built.stderr.strip().splitlines()[-1] == (
        'error: ONNX Runtime is not installed (fix: pip install "enginesmith[cpu]" or "enginesmith[cuda]")')
    assert not (tmp_path / "e").exists()
    doctor = cli_in_site(site, "doctor", "--json", env=env)
    assert doctor.returncode == 0, doctor.stderr
    (ort,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "ONNX Runtime"]
    assert ort["status"] == "missing" and ort["fix"] == onnxruntime_flavour.INSTALL_FIX


def test_mixed_install_stops_run_with_the_uninstall_fix(tmp_path, tiny_engine):
    site = site_without_onnxruntime(tmp_path / "site")
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():  # this venv's real onnxruntime, and onnxruntime-gpu's metadata beside it
        if entry.name == "onnxruntime" or entry.name.startswith("onnxruntime-"):
            (site / entry.name).symlink_to(entry)
    fake_dist(site, "onnxruntime-gpu", "1.31.1", module=False)
    result = cli_in_site(site, "run", "--engine", str(tiny_engine("llama")), "--raw", "hi", "--max-tokens", "2")
    assert_one_line_error(result, 2, "onnxruntime-gpu 1.31.1", "both installed", onnxruntime_flavour.MIXED_FIX)


# ----------------------------------------------------------------------------- finding and compiling the libraries

@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No library variables, a fresh cache; the checkout's own plugins/build (if any) still counts."""
    for var in ("ENGINESMITH_ORT_OPS_LIB", "ENGINESMITH_KERNELS_LIB", plugin_compile.BUILD_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plugin_compile, "PREBUILT_DIR", tmp_path / "no-wheel")  # as in a checkout
    if (plugin_compile.CHECKOUT_BUILD_DIR / ort_ops.LIBRARY).is_file():
        pytest.skip("plugins/build holds a hand-built ops library, which wins over the cache")
    return tmp_path


def test_the_variables_win_over_the_build_folder_and_the_cache(clean_env, monkeypatch):
    entry = plugin_compile.kernels_cache() / plugin_compile.cache_key(("90",))
    entry.mkdir(parents=True)
    (entry / ort_ops.LIBRARY).write_bytes(b"")
    assert plugin_compile.locate("ort_ops", any_arch=True) == plugin_compile.Located(entry / ort_ops.LIBRARY, "cache")
    build = clean_env / "pb"
    build.mkdir()
    monkeypatch.setenv(plugin_compile.BUILD_ENV, str(build))
    assert plugin_compile.locate("ort_ops", any_arch=True).origin == "build-dir"  # set, even if not built there
    own = clean_env / "mine.so"
    monkeypatch.setenv("ENGINESMITH_ORT_OPS_LIB", str(own))
    assert ort_ops.library_path() == own
    with pytest.raises(UserError, match="ops library is not built") as err:
        ort_ops.require()  # named but missing: never silently replaced by another build
    assert "ENGINESMITH_ORT_OPS_LIB" in str(err.value) and "cmake" in err.value.fix


def test_without_a_gpu_first_use_says_how_to_compile(clean_env):
    if plugin_compile.detect_gpu() is not None:
        pytest.skip("this machine has a GPU: first use compiles for it")
    assert not ort_ops.available()
    with pytest.raises(UserError, match="no NVIDIA GPU was found") as err:
        ort_ops.require()
    assert "enginesmith plugins build --arch 90" in err.value.fix


@pytest.mark.parametrize("text, archs", [("90", ("90",)), ("sm_90", ("90",)), ("80,90", ("80", "90")),
                                         ("90a", ("90a",)), ("86;86", ("86",))])
def test_arch_spellings(text, archs):
    assert plugin_compile.parse_archs(text) == archs


@pytest.mark.parametrize("arch, word", [("75", "sm_80 or newer"), ("hopper", "not a CUDA compute capability"),
                                        ("", "not a CUDA compute capability")])
def test_plugins_build_bad_arch_is_one_line(capsys, arch, word):
    assert cli.main(["plugins", "build", "--arch", arch]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and word in err and "--arch 90" in err and "\n" not in err


def _stand_in(monkeypatch, where: Path, release: bool = False) -> Path:
    """run_cmake replaced by tests/helpers/cmake_stand_in.py here and in the processes started from here; the
    file where its calls are recorded."""
    calls = where / "cmake_calls.txt"
    monkeypatch.setenv("STAND_IN_CALLS", str(calls))
    if release:
        monkeypatch.setenv("STAND_IN_RELEASE", str(where / "release"))
    monkeypatch.setattr(plugin_compile, "run_cmake", stand_in_run_cmake)
    return calls


def _wait_for(what, check, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_plugins_build_compiles_once_even_when_two_ask_at_once_then_hits_the_cache(clean_env, monkeypatch):
    """Two `enginesmith plugins build --arch 90` processes at once: one compiles (CMake and nvcc are
    stood in for: cmake_stand_in.py, held until both processes are in), the other waits on the lock
    and finds the entry, which shows no library while the compile is in flight; a third is a hit."""
    calls = _stand_in(monkeypatch, clean_env, release=True)
    cmd = [sys.executable, "-c", LAUNCH_CLI.format(tests=str(REPO / "tests")), "plugins", "build", "--arch", "90"]
    errs = [clean_env / f"err{i}.txt" for i in range(2)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(err, "w"), text=True) for err in errs]
    entry = plugin_compile.kernels_cache() / plugin_compile.cache_key(("90",))
    _wait_for("the first compile", calls.with_suffix(".started").exists)
    assert not any(entry.glob("*.so")), "a library is visible before its compile ended"
    _wait_for("the second process to wait on the lock",
              lambda: any("waiting for another process" in e.read_text() for e in errs))
    (clean_env / "release").touch()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e.read_text() for e in errs]
    expected = f"{entry / ort_ops.LIBRARY}\n{entry / plugin_compile.LIBRARIES['kernels']}\n"
    assert outs == [expected, expected]
    waited, compiled = sorted((e.read_text() for e in errs), key=lambda t: "compiled " in t)
    assert "for sm_90 once" in compiled and "compiled enginesmith_ort_ops, enginesmith_kernels for sm_90 in" in compiled
    assert waited.startswith("enginesmith: waiting for another process") and "compil" not in waited.split("\n", 1)[1]
    assert [line.split()[1:] for line in calls.read_text().splitlines()] == [["enginesmith_ort_ops",
                                                                              "enginesmith_kernels"]]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["archs"] == ["90"] and meta["sources_sha256"] == plugin_compile.sources_sha256()
    assert sorted(meta["libraries"]) == sorted([ort_ops.LIBRARY, plugin_compile.LIBRARIES["kernels"]])
    left = sorted(p.name for p in plugin_compile.kernels_cache().iterdir())
    assert left == [f".{entry.name}.lock", entry.name]  # no temp file, log or build folder left
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == expected and "compil" not in again.stderr
    assert len(calls.read_text().splitlines()) == 1


def test_first_use_compiles_only_the_library_it_needs_and_the_entry_grows(clean_env, monkeypatch, capsys):
    calls = _stand_in(monkeypatch, clean_env)
    monkeypatch.setattr(plugin_compile, "detect_gpu", lambda: plugin_compile.Gpu("H100", "90", None, "test"))
    entry = plugin_compile.kernels_cache() / plugin_compile.cache_key(("90",))
    build = entry.parent / f".{entry.name}.build"
    kernels_lib = plugin_compile.LIBRARIES["kernels"]
    assert plugin_compile.ensure("ort_ops") == entry / ort_ops.LIBRARY
    assert not (entry / kernels_lib).exists() and build.is_dir()  # kept: the kernels reuse its objects
    err = capsys.readouterr().err
    assert "compiling the ONNX Runtime ops library (enginesmith_ort_ops) for sm_90 once" in err
    assert "compiled enginesmith_ort_ops for sm_90 in" in err
    assert plugin_compile.ensure("kernels") == entry / kernels_lib
    assert "compiling the kernels library (enginesmith_kernels) for sm_90" in capsys.readouterr().err
    lines = [line.split() for line in calls.read_text().splitlines()]
    assert lines == [[str(build), "enginesmith_ort_ops"], [str(build), "enginesmith_kernels"]]
    assert not build.exists()  # the entry holds both libraries now
    meta = json.loads((entry / "meta.json").read_text())
    assert {lib: m["target"] for lib, m in meta["libraries"].items()} == {ort_ops.LIBRARY: "enginesmith_ort_ops",
                                                                          kernels_lib: "enginesmith_kernels"}
    assert (entry / ort_ops.LIBRARY).read_bytes() == b"stand-in enginesmith_ort_ops"
    assert plugin_compile.ensure("ort_ops") == entry / ort_ops.LIBRARY and len(calls.read_text().splitlines()) == 2


def test_a_failed_compile_leaves_nothing_behind_and_is_one_line(clean_env, monkeypatch, capsys):
    def failing(build_dir, *args, **kwargs):
        build_dir.mkdir(parents=True)
        (build_dir / "CMakeCache.txt").write_text("CMAKE_CUDA_COMPILER:FILEPATH=/wrong/nvcc\n")
        raise plugin_compile.CompileError("compiling enginesmith's CUDA libraries failed: nvcc fatal", "see the log")

    monkeypatch.setattr(plugin_compile, "run_cmake", failing)
    assert cli.main(["plugins", "build", "--arch", "90"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: compiling enginesmith's CUDA libraries failed: nvcc fatal (fix: see the log)"
    key = plugin_compile.cache_key(("90",))
    assert [p.name for p in plugin_compile.kernels_cache().iterdir()] == [f".{key}.lock"]


def _cuda() -> bool:
    import onnxruntime as ort
    import torch

    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")
def test_first_use_on_a_gpu_compiles_for_it_and_the_engine_runs(clean_env, capsys):
    """Nothing built, a fresh cache: build --custom-ops on compiles the libraries for this GPU's arch
    (detected), and the engine then runs on CUDA with them without compiling again."""
    gpu = plugin_compile.detect_gpu()
    assert gpu is not None and not ort_ops.available()
    out = clean_env / "e"
    assert cli.main(["build", "--model", "tiny:llama", "--dtype", "fp16", "--for-cuda", "--custom-ops", "on",
                     "--out", str(out)]) == 0
    assert f"compiling the ONNX Runtime ops library (enginesmith_ort_ops) for sm_{gpu.arch}" in capsys.readouterr().err
    assert ort_ops.available()
    assert ort_ops.library_path().parent.name == plugin_compile.cache_key((gpu.arch,))
    assert cli.main(["run", "--engine", str(out), "--device", "cuda", "--raw", "hello", "--max-tokens", "8"]) == 0
    assert "compiling" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- doctor

def test_doctor_reports_this_machine_and_exits_0(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ENGINESMITH_ORT_OPS_LIB", str(tmp_path / "missing.so"))
    assert cli.main(["doctor", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    gpu = plugin_compile.detect_gpu()
    if gpu is None:
        assert checks["GPU"]["status"] == "missing" and "no NVIDIA GPU found" in checks["GPU"]["value"]
    else:
        assert checks["GPU"]["details"]["arch"] == gpu.arch
    import onnxruntime as ort

    assert checks["ONNX Runtime"]["details"]["version"] == ort.__version__
    assert checks["ONNX Runtime"]["details"]["providers"] == ort.get_available_providers()
    assert checks["ops library"]["status"] == "error" and "missing.so" in checks["ops library"]["value"]
    for tool in ("nvcc", "cmake", "ninja", "C++ compiler"):
        assert checks[tool]["status"] in ("ok", "missing") and (checks[tool]["status"] == "ok" or checks[tool]["fix"])
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "ONNX Runtime" in text and "fix: build it there" in text


def test_doctor_without_a_gpu_asks_for_no_compile(clean_env, monkeypatch, capsys):
    """Nothing built on a machine without a GPU is fine (--device cpu needs no library): an info line
    each, no fix, and no `plugins build --arch 90` offered as if it were needed."""
    monkeypatch.setattr(plugin_compile, "detect_gpu", lambda: None)
    assert cli.main(["doctor", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    for label in ("ops library", "kernels library", "TensorRT plugins"):
        assert checks[label]["status"] == "info" and checks[label]["fix"] == "", checks[label]
        assert "--device cpu needs none" in checks[label]["value"]
    assert cli.main(["doctor"]) == 0
    assert "--arch 90" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- build --for-cuda knobs

@pytest.mark.parametrize("extra, word", [
    (["--for-cuda", "--dtype", "fp16", "--quantize-lm-head"], "needs --quant w4a16-rtn"),
    (["--for-cuda", "--dtype", "fp16", "--max-batch", "0"], "--max-batch 0 is outside 1..256"),
    (["--for-cuda", "--dtype", "fp16", "--page-size", "32"], "--page-size applies to --kv paged"),
    (["--max-batch", "4"], "--max-batch belongs to --for-cuda"),
    (["--quantize-lm-head"], "--quantize-lm-head belongs to --for-cuda"),
    (["--page-size", "32"], "--page-size applies to --kv paged, not --kv dense"),
    (["--kv", "paged", "--page-size", "0"], "--page-size 0 is not a positive"),
])
def test_build_knobs_are_validated_before_any_work(capsys, tmp_path, extra, word):
    assert cli.main(["build", "--model", "tiny:llama", "--out", str(tmp_path / "e"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and word in err and "(fix: " in err and "\n" not in err
    assert not (tmp_path / "e").exists()


def test_for_cuda_max_batch_and_int4_lm_head_reach_the_engine(capsys, tmp_path):
    out = tmp_path / "e"
    assert cli.main(["build", "--model", "tiny:llama", "--dtype", "fp16", "--for-cuda", "--quant", "w4a16-rtn",
                     "--quantize-lm-head", "--max-batch", "2", "--custom-ops", "off", "--out", str(out)]) == 0
    manifest = json.loads((out / "build.json").read_text())
    assert manifest["kv_layout"]["max_batch"] == 2
    passes = " ".join(manifest["passes"])
    assert "untie_lm_head" in passes and "include_lm_head=true" in passes
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert manifest["pass_counts"]["quantize_w4a16"]["skipped"] == 0  # the lm_head is int4 too
    assert {n.op_type for n in graph.node if "MatMul" in n.op_type} == {"MatMulNBits"}
    capsys.readouterr()
    assert cli.main(["run", "--engine", str(out), "--device", "cpu", "--raw", "a", "b", "c", "--max-tokens", "2"]) == 2
    assert "3 sequences at once exceed the --max-batch 2" in capsys.readouterr().err
    assert cli.main(["run", "--engine", str(out), "--device", "cpu", "--raw", "a", "b", "--max-tokens", "2"]) == 0
