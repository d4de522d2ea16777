"""One install for GPU users: the ONNX Runtime flavour check, the sources in the wheel, compiling the
CUDA libraries on first use into the cache, `enginesmith doctor`, and the --for-cuda build knobs.

Installs are real: a wheel built by pip, site-packages folders with pip's dist-info metadata, the
CLI run in processes that see exactly those folders. The compile test runs CMake and nvcc for sm_90
(a few minutes on 2 cores; the CPU machines have nvcc 13, no GPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import onnx
import pytest

from enginesmith import cli
from enginesmith.core import onnxruntime_flavour
from enginesmith.core.errors import UserError
from enginesmith.plugins import compile as plugin_compile
from enginesmith.plugins import ort_ops
from external import missing
from test_cli_errors import assert_one_line_error

REPO = Path(__file__).resolve().parents[1]


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


# ----------------------------------------------------------------------------- the wheel

@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """pip's wheel of this checkout (tracked and untracked-but-not-ignored files, as CI's clone has)."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    (src / "plugins" / "build").mkdir()  # a hand build in the checkout must not ship
    (src / "plugins" / "build" / "stray.cpp").write_text("// built output\n")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                           "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("enginesmith-*.whl")
    return whl


def test_the_wheel_ships_every_source_cmake_builds_from(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"enginesmith/plugins/{p.relative_to(plugin_compile.PLUGINS_DIR).as_posix()}"
              for p in plugin_compile.source_files()}
    assert "enginesmith/plugins/CMakeLists.txt" in wanted and "enginesmith/plugins/ort_ops/ort_abi.h" in wanted
    assert wanted <= names, sorted(wanted - names)
    assert "enginesmith/plugins/sparse_gemm/profitability.json" in names
    assert not [n for n in names if n.startswith("enginesmith/plugins/build/")]
    # Installed from the wheel alone (no checkout, no site-packages), compile.py finds the sources
    # beside itself, and they hash like the checkout's: the same cache key.
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = ("import json; from enginesmith.plugins import compile as c; "
            "print(json.dumps([str(c.PLUGINS_DIR), c.sources_sha256()]))")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(target)}, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    where, sha = json.loads(proc.stdout)
    assert Path(where) == target / "enginesmith" / "plugins" and (Path(where) / "CMakeLists.txt").is_file()
    assert sha == plugin_compile.sources_sha256()


# ----------------------------------------------------------------------------- finding and compiling the libraries

@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No library variables, a fresh cache; the checkout's own plugins/build (if any) still counts."""
    for var in ("ENGINESMITH_ORT_OPS_LIB", "ENGINESMITH_KERNELS_LIB", plugin_compile.BUILD_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))
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


def test_plugins_build_compiles_once_even_when_two_ask_at_once_then_hits_the_cache(clean_env, monkeypatch):
    """Two `enginesmith plugins build --arch 90` at the same time: one compiles, the other waits on the
    lock and finds the entry; a third call is a cache hit; the ops library then loads into ORT here."""
    for tool, found in (("nvcc", plugin_compile.find_nvcc()), ("cmake", plugin_compile.find_cmake())):
        if found is None:
            missing(f"{tool} is not installed: the CUDA libraries cannot be compiled here",
                    'install the CUDA toolkit and pip install "enginesmith[cuda]"')
    env = {**os.environ, "ENGINESMITH_CACHE": str(clean_env / "cache")}
    cmd = [sys.executable, "-m", "enginesmith.cli", "plugins", "build", "--arch", "90"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=1500) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    entry = plugin_compile.kernels_cache() / plugin_compile.cache_key(("90",))
    expected = f"{entry / ort_ops.LIBRARY}\n{entry / plugin_compile.LIBRARIES['kernels']}\n"
    assert [out for out, _ in outs] == [expected, expected]
    errs = sorted(err for _, err in outs)  # the compiling one, then the one that waited on the lock
    assert "compiled in" in errs[0] and errs[1].startswith("enginesmith: waiting for another process"), errs
    assert "compiled in" not in errs[1]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["archs"] == ["90"] and meta["sources_sha256"] == plugin_compile.sources_sha256()
    assert [p.name for p in plugin_compile.kernels_cache().iterdir() if not p.name.endswith(".lock")] == [entry.name]

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and again.stdout == expected and "compiling" not in again.stderr

    import onnxruntime as ort

    path = ort_ops.require()  # no GPU here: any compiled entry for these sources serves the CPU kernels
    assert path == entry / ort_ops.LIBRARY
    ort.SessionOptions().register_custom_ops_library(str(path))


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
    assert f"compiling the CUDA libraries for sm_{gpu.arch}" in capsys.readouterr().err
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
