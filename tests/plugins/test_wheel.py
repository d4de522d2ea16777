"""The wheels: source-only by default (the CUDA sources inside, compiled on first use), or, with
$ENGINESMITH_KERNEL_ARCHS, binary: the compiled libraries in enginesmith/plugins/prebuilt/ with their
meta.json (setup.py's hook, plugins/prebuilt.py), found once installed with origin "wheel".

Wheels are built by pip from a copy of the checkout, installed with pip into a folder, and used by
processes that see that folder, not the checkout. The binary wheel takes the libraries the tests
already compiled (tests/helpers/plugin_build.py's shared build folder, one arch: the ops, and the kernels,
which reuse the ops' paged-attention objects) through $ENGINESMITH_PREBUILT_FROM: no second compile.
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

import pytest

from enginesmith.core.errors import UserError
from enginesmith.plugins import compile as plugin_compile
from enginesmith.plugins import prebuilt
from helpers.cmake_stand_in import stand_in_run_cmake
from helpers.external import missing
from helpers.plugin_build import compile_targets

REPO = Path(__file__).resolve().parents[2]
LIBS = (plugin_compile.LIBRARIES["ort_ops"], plugin_compile.LIBRARIES["kernels"])


def source_copy(dest: Path) -> Path:
    """This checkout's files (tracked and untracked-but-not-ignored, as CI's clone has) in `dest`."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


def pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (prebuilt.ARCHS_ENV, prebuilt.FROM_ENV, prebuilt.TRT_ENV)}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600,
                          env={**base, **(env or {})})


def pip_wheel(src: Path, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return pip("wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(out), env=env)


# ----------------------------------------------------------------------------- the source-only wheel

@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = source_copy(tmp_path_factory.mktemp("src"))
    (src / "plugins" / "build").mkdir()  # a hand build in the checkout must not ship
    (src / "plugins" / "build" / "stray.cpp").write_text("// built output\n")
    (src / "plugins" / "prebuilt").mkdir()  # nor a stray prebuilt folder: only the build hook fills it
    (src / "plugins" / "prebuilt" / "meta.json").write_text("{}\n")
    out = tmp_path_factory.mktemp("wheel")
    proc = pip_wheel(src, out)
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
    assert not [n for n in names if n.startswith(("enginesmith/plugins/build/", "enginesmith/plugins/prebuilt/"))]
    assert wheel.name.endswith("-py3-none-any.whl")  # no compiled code: one wheel for every platform
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


def test_an_editable_install_compiles_nothing(tmp_path):
    """$ENGINESMITH_KERNEL_ARCHS is ignored by an editable install: the hook would refuse this
    $ENGINESMITH_PREBUILT_FROM, so the editable wheel being made shows that it did not run. (The
    backend's build_editable, which `pip install -e` calls, run directly: pip would replace this
    venv's own editable install, even with --prefix.)"""
    src = source_copy(tmp_path / "src")
    code = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    env = {**os.environ, prebuilt.ARCHS_ENV: "90", prebuilt.FROM_ENV: str(tmp_path / "nothing-here")}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=str(src), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "an editable install compiles nothing" in proc.stdout
    (whl,) = (tmp_path / "out").glob("enginesmith-*.whl")
    assert not [n for n in zipfile.ZipFile(whl).namelist() if "prebuilt/" in n or n.endswith(".so")]
    assert not (src / "plugins" / "prebuilt").exists() and not list(src.rglob("libenginesmith_*.so"))


def test_a_bad_prebuilt_folder_fails_the_wheel_in_one_line(tmp_path):
    src = source_copy(tmp_path / "src")
    env = {prebuilt.ARCHS_ENV: "90", prebuilt.FROM_ENV: str(tmp_path)}
    proc = pip_wheel(src, tmp_path / "out", env=env)
    assert proc.returncode != 0 and not list((tmp_path / "out").glob("*.whl"))
    ours = [line.strip() for line in proc.stderr.splitlines() if "ENGINESMITH_PREBUILT_FROM" in line]
    assert ours == [f"error: {prebuilt.FROM_ENV}={tmp_path} is neither a CMake build folder nor a cache entry "
                    f"(fix: point {prebuilt.FROM_ENV} at a build of these sources for 90, or unset it to compile)"]


# ----------------------------------------------------------------------------- the binary wheel, really compiled

@pytest.fixture(scope="module")
def compiled_build(request, ort_ops_lib) -> Path:
    """A CMake build folder of these sources holding both libraries for one arch: the session's shared
    build (tests/helpers/plugin_build.py) with the kernels target built there too (ninja rebuilds it if
    an earlier session left it behind its sources; it reuses the ops' paged-attention objects), or
    $ENGINESMITH_PLUGINS_BUILD when it holds both."""
    folder = ort_ops_lib.parent
    if os.environ.get("ENGINESMITH_ORT_OPS_LIB") or os.environ.get(plugin_compile.BUILD_ENV):
        if all((folder / lib).is_file() for lib in LIBS) and (folder / "CMakeCache.txt").is_file():
            return folder
        missing(f"{folder} is not a CMake build folder of both libraries (named by the environment)",
                "point ENGINESMITH_PLUGINS_BUILD at a build folder of both libraries, or unset the variables")
    built = compile_targets(request.config, ("enginesmith_kernels",), what="the kernels library")
    assert built == folder, (built, folder)
    return folder


def _site_without_enginesmith(dest: Path) -> Path:
    """Links to this venv's packages, enginesmith's editable install left out."""
    dest.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("enginesmith", "__editable__")):
            (dest / entry.name).symlink_to(entry)
    return dest


FIND = """
import json, shutil, site, sys
site.addsitedir(sys.argv[1])
site.addsitedir(sys.argv[2])
import onnxruntime as ort
from enginesmith.plugins import compile as c
from enginesmith.cli import doctor
found = {n: c.locate(n, any_arch=True) for n in ("ort_ops", "kernels")}
paths = {n: str(c.ensure(n)) for n in found}
ort.SessionOptions().register_custom_ops_library(paths["ort_ops"])
checks = {k.name: k.details for k in doctor.checks()}
print(json.dumps({"plugins": str(c.PLUGINS_DIR), "nvcc": shutil.which("nvcc"), "paths": paths,
                  "origins": {n: w.origin for n, w in found.items()},
                  "doctor": {n: checks[n] for n in ("ops library", "kernels library")}}))
"""


def test_a_wheel_with_kernel_archs_carries_the_libraries_and_an_install_finds_them(compiled_build, tmp_path):
    archs = plugin_compile.build_dir_archs(compiled_build / LIBS[0])
    env = {prebuilt.ARCHS_ENV: archs, prebuilt.FROM_ENV: str(compiled_build)}
    proc = pip_wheel(source_copy(tmp_path / "src"), tmp_path / "out", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = (tmp_path / "out").glob("enginesmith-*.whl")
    assert whl.name.endswith("-py3-none-linux_x86_64.whl")  # compiled code: this platform only
    with zipfile.ZipFile(whl) as z:
        shipped = sorted(n.removeprefix("enginesmith/plugins/prebuilt/") for n in z.namelist()
                         if n.startswith("enginesmith/plugins/prebuilt/"))
        meta = json.loads(z.read("enginesmith/plugins/prebuilt/meta.json"))
    assert shipped == sorted([*LIBS, "meta.json"])  # no TensorRT plugins without TENSORRT_ROOT
    assert meta["archs"] == archs.split(";") and meta["sources_sha256"] == plugin_compile.sources_sha256()
    assert meta["from"] == str(compiled_build) and meta["nvcc"] and not meta["trt"]
    for lib in LIBS:
        assert meta["libraries"][lib]["bytes"] == (compiled_build / lib).stat().st_size

    site = tmp_path / "site"
    proc = pip("install", "-q", "--no-deps", "--target", str(site), str(whl))
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvcc").exists())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINESMITH_", "CUDA"))}
    env.update(PATH=path, ENGINESMITH_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-S", "-c", FIND, str(site), str(_site_without_enginesmith(tmp_path / "v"))],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found["plugins"] == str(site / "enginesmith" / "plugins") and found["nvcc"] is None
    assert found["origins"] == {"ort_ops": "wheel", "kernels": "wheel"}
    assert found["paths"] == {n: str(site / "enginesmith/plugins/prebuilt" / plugin_compile.LIBRARIES[n])
                              for n in ("ort_ops", "kernels")}
    assert {c["origin"] for c in found["doctor"].values()} == {"wheel"}
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing cached


# ----------------------------------------------------------------------------- which wheel library counts

@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """plugins/prebuilt/ as a binary wheel for sm_90 leaves it (empty library files), a fresh cache."""
    for var in ("ENGINESMITH_ORT_OPS_LIB", "ENGINESMITH_KERNELS_LIB", plugin_compile.BUILD_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))
    if any((plugin_compile.CHECKOUT_BUILD_DIR / lib).is_file() for lib in LIBS):
        pytest.skip("plugins/build holds a hand-built library, which wins over the wheel")
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    for lib in LIBS:
        (folder / lib).write_bytes(b"")
    meta = {"archs": ["90"], "sources_sha256": plugin_compile.sources_sha256(), "libraries": {lib: {} for lib in LIBS}}
    (folder / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(plugin_compile, "PREBUILT_DIR", folder)
    return folder


def _gpu(monkeypatch, arch: str | None) -> None:
    gpu = plugin_compile.Gpu("test GPU", arch, None, "test") if arch else None
    monkeypatch.setattr(plugin_compile, "detect_gpu", lambda: gpu)


@pytest.mark.parametrize("arch, origin", [("90", "wheel"), ("100", "cache"), ("86", "cache"), ("80", "cache")])
def test_the_wheels_library_counts_for_a_gpu_it_has_sass_for(fake_wheel, monkeypatch, arch, origin):
    _gpu(monkeypatch, arch)
    where = plugin_compile.locate("ort_ops")
    assert where.origin == origin and where.built == (origin == "wheel")  # cache: compiled there on first use


def test_without_nvcc_a_newer_gpu_takes_the_wheels_ptx_an_older_one_cannot(fake_wheel, monkeypatch):
    monkeypatch.setattr(plugin_compile, "find_nvcc", lambda: None)
    _gpu(monkeypatch, "100")  # sm_90's PTX: the driver compiles it for sm_100 at load
    assert plugin_compile.ensure("kernels") == fake_wheel / LIBS[1]
    _gpu(monkeypatch, "86")   # neither SASS nor PTX for sm_86 (90 > 86), and nothing to compile with
    with pytest.raises(plugin_compile.CompileError, match="nvcc .* is not found"):
        plugin_compile.ensure("kernels")


def test_the_wheels_library_after_the_variables_and_only_from_these_sources(fake_wheel, monkeypatch, tmp_path):
    _gpu(monkeypatch, None)
    assert plugin_compile.locate("kernels") is None  # no GPU: only when any compiled library will do
    assert plugin_compile.locate("kernels", any_arch=True) == plugin_compile.Located(fake_wheel / LIBS[1], "wheel")
    monkeypatch.setenv("ENGINESMITH_KERNELS_LIB", str(tmp_path / "mine.so"))
    assert plugin_compile.locate("kernels", any_arch=True).origin == "env"
    monkeypatch.delenv("ENGINESMITH_KERNELS_LIB")
    meta = json.loads((fake_wheel / "meta.json").read_text())
    (fake_wheel / "meta.json").write_text(json.dumps({**meta, "sources_sha256": "0" * 64}))
    assert plugin_compile.locate("kernels", any_arch=True) is None  # compiled from other sources: not used


def test_doctor_says_where_the_wheels_libraries_do_not_cover_the_gpu(fake_wheel, monkeypatch, capsys):
    from enginesmith import cli

    _gpu(monkeypatch, "86")
    assert cli.main(["doctor", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    ops = checks["ops library"]
    assert ops["status"] == "missing" and "the wheel's is for sm 90, not this GPU's sm_86" in ops["value"]
    assert ops["fix"] == "`enginesmith plugins build` compiles it now"
    _gpu(monkeypatch, "90")
    assert cli.main(["doctor"]) == 0
    assert f"{fake_wheel / LIBS[0]} (shipped in the wheel, sm 90)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- $ENGINESMITH_PREBUILT_FROM, checked

@pytest.fixture
def cmake_folder(tmp_path) -> Path:
    """What a CMake build folder of these sources for sm_90 looks like to the hook (libraries newer
    than the sources)."""
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "CMakeCache.txt").write_text(f"CMAKE_CUDA_ARCHITECTURES:STRING=90\n"
                                           f"CMAKE_HOME_DIRECTORY:INTERNAL={plugin_compile.PLUGINS_DIR}\n")
    for lib in LIBS:
        (folder / lib).write_bytes(b"\x7fELF " + lib.encode())
    return folder


def test_the_hook_stages_a_checked_build_folder(cmake_folder, tmp_path, monkeypatch):
    monkeypatch.delenv(prebuilt.TRT_ENV, raising=False)
    monkeypatch.delenv(prebuilt.ARCHS_ENV, raising=False)
    assert prebuilt.stage_from_environment(tmp_path / "p", tmp_path / "w", say=lambda _: None) is None
    assert not (tmp_path / "p").exists()  # no variable: a source-only wheel
    monkeypatch.setenv(prebuilt.ARCHS_ENV, "sm_90")
    monkeypatch.setenv(prebuilt.FROM_ENV, str(cmake_folder))
    meta = prebuilt.stage_from_environment(tmp_path / "p", tmp_path / "w", say=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == sorted([*LIBS, "meta.json"])
    assert json.loads((tmp_path / "p" / "meta.json").read_text()) == meta
    assert meta["archs"] == ["90"] and set(meta["libraries"]) == set(LIBS) and not (tmp_path / "w").exists()


@pytest.mark.parametrize("trt", [False, True])
def test_without_a_build_folder_the_hook_compiles_the_targets(tmp_path, monkeypatch, trt):
    """No $ENGINESMITH_PREBUILT_FROM: run_cmake compiles exactly the wheel's targets in the build's temp
    folder (CMake and nvcc stood in for: tests/helpers/cmake_stand_in.py); TENSORRT_ROOT adds the plugins."""
    monkeypatch.setenv("STAND_IN_CALLS", str(tmp_path / "calls.txt"))
    monkeypatch.setattr(plugin_compile, "run_cmake", stand_in_run_cmake)
    monkeypatch.setattr(plugin_compile, "find_nvcc", lambda: None)  # the meta says what it found
    monkeypatch.setenv(prebuilt.ARCHS_ENV, "80;90")
    monkeypatch.delenv(prebuilt.FROM_ENV, raising=False)
    if trt:
        monkeypatch.setenv(prebuilt.TRT_ENV, str(tmp_path / "tensorrt"))
    else:
        monkeypatch.delenv(prebuilt.TRT_ENV, raising=False)
    said: list[str] = []
    meta = prebuilt.stage_from_environment(tmp_path / "p", tmp_path / "w", say=said.append)
    targets = ["enginesmith_ort_ops", "enginesmith_kernels"] + ["enginesmith_trt_plugins"] * trt
    assert (tmp_path / "calls.txt").read_text().split() == [str(tmp_path / "w" / "enginesmith-kernels"), *targets]
    assert said[0] == f"enginesmith: compiling {', '.join(targets)} for sm 80;90 into the wheel ..."
    assert said[-1].startswith("enginesmith: compiled in ")
    assert meta["from"] == "compiled" and meta["archs"] == ["80", "90"] and meta["trt"] == trt
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == sorted(
        [*(f"lib{t}.so" for t in targets), "meta.json"])


@pytest.mark.parametrize("change, words", [
    ("archs", "was compiled for 90, ENGINESMITH_KERNEL_ARCHS asks for 80;90"),
    ("no kernels", "holds no libenginesmith_kernels.so"),
    ("other sources", "was compiled from other sources than these"),
    ("stale", "is out of date with its sources"),
    ("bad arch", "ENGINESMITH_KERNEL_ARCHS='75' is not a list of CUDA archs the kernels support"),
])
def test_the_hook_refuses_a_build_folder_that_does_not_fit(cmake_folder, tmp_path, monkeypatch, change, words):
    monkeypatch.delenv(prebuilt.TRT_ENV, raising=False)  # CI sets it: the wheel would want the plugins too
    monkeypatch.setenv(prebuilt.ARCHS_ENV, {"archs": "80;90", "bad arch": "75"}.get(change, "90"))
    monkeypatch.setenv(prebuilt.FROM_ENV, str(cmake_folder))
    if change == "no kernels":
        (cmake_folder / LIBS[1]).unlink()
    elif change == "other sources":
        other = shutil.copytree(plugin_compile.PLUGINS_DIR, tmp_path / "other", ignore=shutil.ignore_patterns("build"))
        (other / "limits.json").write_text((other / "limits.json").read_text() + "\n")
        text = (cmake_folder / "CMakeCache.txt").read_text().replace(str(plugin_compile.PLUGINS_DIR), str(other))
        (cmake_folder / "CMakeCache.txt").write_text(text)
    elif change == "stale":
        os.utime(cmake_folder / LIBS[0], (1, 1))
    with pytest.raises(UserError, match=words.replace(".", r"\.")) as err:
        prebuilt.stage_from_environment(tmp_path / "p", tmp_path / "w", say=lambda _: None)
    assert err.value.fix and not (tmp_path / "p").exists() and not (tmp_path / ".p.tmp").exists()
