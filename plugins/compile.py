"""Find enginesmith's CUDA libraries, or compile them on first use into a per-machine cache.

The package ships plugins/' C++/CUDA sources and CMakeLists.txt as package data, so a source install
can build the libraries where they run: CMake and Ninja (the PyPI packages that `enginesmith[cuda]`
installs, else those on PATH) drive nvcc. A binary wheel (setup.py, plugins/prebuilt.py) also carries
them compiled for the common archs in plugins/prebuilt/, so most users compile nothing.

A build goes to cache_dir()/kernels/<key>/, where the key names the sources' sha256, the GPU arch(s)
and the ONNX Runtime version, so a changed source, another GPU or another ONNX Runtime gets its own
entry and an entry never goes stale. An entry grows one library at a time: `ensure("ort_ops")`
compiles only the CMake target enginesmith_ort_ops, a later `ensure("kernels")` only
enginesmith_kernels, in the key's build folder (the second reuses the objects both link), under one
lock file per key. Each library is renamed into the entry when done and recorded in its meta.json, so
two processes never compile the same library twice and nobody sees half a library.

Libraries (CMake targets of CMakeLists.txt):
    ort_ops      libenginesmith_ort_ops.so       ONNX Runtime custom ops (compiled on first use)
    kernels      libenginesmith_kernels.so       the plugin kernels behind a C API (compiled on first use)
    trt_plugins  libenginesmith_trt_plugins.so   TensorRT plugins (`enginesmith plugins build --trt` only:
                                                 needs the TensorRT headers, $TENSORRT_ROOT)

Where a library is looked for, first hit wins (the older variables keep working and win):
    1. its own variable, a file: $ENGINESMITH_ORT_OPS_LIB, $ENGINESMITH_KERNELS_LIB
    2. $ENGINESMITH_PLUGINS_BUILD, a CMake build folder (made by hand or by `enginesmith plugins build`)
    3. plugins/build/ of a source checkout, if it holds the library (plugins/README.md's cmake commands)
    4. plugins/prebuilt/ of a binary wheel, if compiled from these sources with SASS for this machine's
       GPU (on a machine without a GPU: when any compiled library will do; a GPU the wheel has only
       PTX for compiles natively on first use, or, with no nvcc there, the driver JIT-compiles the PTX)
    5. the cache entry for this machine's GPU (compiled there on first use)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import inspect as inspect_onnxruntime
from enginesmith.core.paths import cache_dir, writing_to
# What the machine has (re-exported: doctor, the CLI and the tests ask this module).
from enginesmith.plugins.toolchain import (Gpu, arch_covers, detect_gpu, find_cmake, find_ninja,  # noqa: F401
                                           find_nvcc, find_tensorrt_headers, tool_version)

PLUGINS_DIR = Path(__file__).resolve().parent
CHECKOUT_BUILD_DIR = PLUGINS_DIR / "build"
PREBUILT_DIR = PLUGINS_DIR / "prebuilt"  # a binary wheel's compiled libraries and their meta.json
LIBRARIES = {
    "ort_ops": "libenginesmith_ort_ops.so",
    "kernels": "libenginesmith_kernels.so",
    "trt_plugins": "libenginesmith_trt_plugins.so",
}
TARGETS = {"ort_ops": "enginesmith_ort_ops", "kernels": "enginesmith_kernels",
           "trt_plugins": "enginesmith_trt_plugins"}  # the CMake target of each library
DESCRIPTIONS = {"ort_ops": "ONNX Runtime ops library", "kernels": "kernels library",
                "trt_plugins": "TensorRT plugin library"}
LIBRARY_ENV = {"ort_ops": "ENGINESMITH_ORT_OPS_LIB", "kernels": "ENGINESMITH_KERNELS_LIB"}
BUILD_ENV = "ENGINESMITH_PLUGINS_BUILD"
# What CMakeLists.txt compiles from; their bytes make the sources' part of the cache key.
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".cmake")
SOURCE_NAMES = ("CMakeLists.txt", "limits.json")  # limits.json: the kernels' limits, compiled in
MIN_ARCH = 80  # cp.async, ldmatrix and the bf16 MMAs of the kernels need sm_80 or newer
ARCH_FIX = "pass the GPU's compute capability without the dot, e.g. --arch 90 (H100/H200), 80 (A100) or 80,90"


class CompileError(UserError):
    """Compiling the libraries failed (no nvcc, no compiler, a CMake or nvcc error); names the log."""


# ----------------------------------------------------------------------------- the key's parts

def source_files(root: Path = PLUGINS_DIR) -> list[Path]:
    """The files CMakeLists.txt builds from, sorted; build folders and caches left out."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("build", "prebuilt") and not d.startswith((".", "__")))
        for name in filenames:
            if name in SOURCE_NAMES or name.endswith(SOURCE_SUFFIXES):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@lru_cache(maxsize=None)
def sources_sha256(root: Path = PLUGINS_DIR) -> str:
    """sha256 over the sources' relative paths and bytes."""
    h = hashlib.sha256()
    for path in source_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def parse_archs(text: str) -> tuple[str, ...]:
    """"90", "sm_90", "80,90", "90a", "80-real;90" -> ("90",), ("80", "90"), ("90a",), ("80-real", "90")
    (CMake's spelling: -real is SASS only, -virtual PTX only); a UserError for anything else."""
    items = [a.strip().lower().removeprefix("sm_").removeprefix("sm") for a in text.replace(";", ",").split(",")]
    archs: list[str] = []
    for item in items:
        m = re.fullmatch(r"(\d{2,3})(a?)(-real|-virtual)?", item)
        if not m:
            raise UserError(f"--arch {text!r} is not a CUDA compute capability", ARCH_FIX)
        if int(m.group(1)) < MIN_ARCH:
            raise UserError(f"--arch {item}: the kernels need sm_{MIN_ARCH} or newer", ARCH_FIX)
        if item not in archs:
            archs.append(item)
    if not archs:
        raise UserError("--arch is empty", ARCH_FIX)
    return tuple(archs)


def onnxruntime_version() -> str:
    install = inspect_onnxruntime()
    return install.version or ("none" if install.module_dir is None else "unknown")


def _ort_tag() -> str:
    return "ort" + re.sub(r"[^\w.]+", "_", onnxruntime_version())


def cache_key(archs: tuple[str, ...], trt: bool = False) -> str:
    """<sources sha256, 16 hex>-sm<archs>-ort<version>[-trt]: readable, and unique per build input."""
    return f"{sources_sha256()[:16]}-sm{'_'.join(archs)}-{_ort_tag()}" + ("-trt" if trt else "")


def kernels_cache() -> Path:
    return cache_dir() / "kernels"


# ----------------------------------------------------------------------------- finding a library

@dataclass(frozen=True)
class Located:
    path: Path
    # "env" (its own variable), "build-dir" ($ENGINESMITH_PLUGINS_BUILD), "checkout", "wheel", "cache"
    origin: str

    @property
    def built(self) -> bool:
        return self.path.is_file()


def _cache_entries(archs: tuple[str, ...] | None) -> list[Path]:
    """Cache entries for these sources and this ONNX Runtime: for `archs` (plain before -trt), or
    with archs None every arch, newest first."""
    root = kernels_cache()
    if archs is not None:
        return [root / cache_key(archs), root / cache_key(archs, trt=True)]
    prefix, suffix = f"{sources_sha256()[:16]}-sm", f"-{_ort_tag()}"
    try:
        found = [p for p in root.iterdir()
                 if p.name.startswith(prefix) and p.name.removesuffix("-trt").endswith(suffix)]
    except OSError:
        return []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def locate(name: str, any_arch: bool = False) -> Located | None:
    """Where library `name` ("ort_ops", "kernels", "trt_plugins") is or would be, by the order in the
    module docstring. A variable that is set wins even when its file is missing. The wheel's library
    and the cache entry count when compiled for this machine's GPU; without a GPU, `any_arch` takes
    any compiled one for these sources (the ops' CPU kernels run anywhere), else there is none (None)."""
    lib = LIBRARIES[name]
    env = LIBRARY_ENV.get(name)
    if env and os.environ.get(env):
        return Located(Path(os.environ[env]), "env")
    if os.environ.get(BUILD_ENV):
        return Located(Path(os.environ[BUILD_ENV]) / lib, "build-dir")
    if (CHECKOUT_BUILD_DIR / lib).is_file():
        return Located(CHECKOUT_BUILD_DIR / lib, "checkout")
    gpu = detect_gpu()
    shipped = wheel_library(name)
    if shipped is not None and (arch_covers(shipped_archs(), gpu.arch, ptx=False) if gpu else any_arch):
        return Located(shipped, "wheel")
    entries = _cache_entries((gpu.arch,)) if gpu else _cache_entries(None) if any_arch else []
    for entry in entries:
        if (entry / lib).is_file():
            return Located(entry / lib, "cache")
    if gpu:
        return Located(kernels_cache() / cache_key((gpu.arch,)) / lib, "cache")
    return None


def ensure(name: str, progress: bool = True) -> Path:
    """Library `name`'s path, its CMake target alone compiled into the cache first if it is not there
    (for this machine's GPU; where no nvcc is installed, a wheel's PTX for an older arch is taken
    instead). A variable that names a missing file, or a machine without a GPU and without a compiled
    library, is a UserError that says what to do."""
    where = locate(name, any_arch=True)
    if where is not None and where.built:
        return where.path
    lib, what = LIBRARIES[name], f"the enginesmith {DESCRIPTIONS[name]}"
    if where is not None and where.origin in ("env", "build-dir"):
        var = LIBRARY_ENV[name] if where.origin == "env" else BUILD_ENV
        raise UserError(f"{what} is not built ({where.path} not found; ${var} points there)",
                        f"build it there with cmake (plugins/README.md), or unset {var} and run "
                        "`enginesmith plugins build`")
    if name == "trt_plugins":
        raise UserError(f"{what} is not built ({lib})", "run `enginesmith plugins build --trt` (needs TENSORRT_ROOT)")
    gpu = detect_gpu()
    if gpu is None:
        raise UserError(f"{what} is not built ({lib}) and no NVIDIA GPU was found to compile it for",
                        "run `enginesmith plugins build --arch 90` (the compute capability of the GPU it is for, "
                        "without the dot: 90 for H100/H200, 80 for A100), or set " + LIBRARY_ENV.get(name, BUILD_ENV))
    shipped = wheel_library(name)
    if shipped is not None and find_nvcc() is None and arch_covers(shipped_archs(), gpu.arch):
        return shipped  # no compiler here, but the wheel has PTX the driver compiles at load
    entry = build_cached((gpu.arch,), names=(name,), progress=progress)
    return entry / lib


def wheel_library(name: str) -> Path | None:
    """Library `name` in plugins/prebuilt/ if a binary wheel put it there and compiled it from these
    sources (whatever the arch: locate() checks that), else None."""
    path = PREBUILT_DIR / LIBRARIES[name]
    meta = entry_meta(path)
    if meta is None or not path.is_file() or meta.get("sources_sha256") != sources_sha256():
        return None
    return path if LIBRARIES[name] in meta.get("libraries", ()) else None


def shipped_archs() -> list[str]:
    """The archs plugins/prebuilt/'s libraries were compiled for (CMake's spelling), [] without them."""
    meta = entry_meta(PREBUILT_DIR / "meta.json")
    return [str(a) for a in meta.get("archs", [])] if meta else []


# ----------------------------------------------------------------------------- compiling

def cmake_commands(build_dir: Path, archs: str, trt: bool, tensorrt_root: str | None = None,
                   jobs: int | None = None, targets: Iterable[str] = ()) -> list[list[str]]:
    """The configure and build commands for plugins/ into `build_dir` (archs: CMake's list, "80;90");
    the build makes only `targets` (CMake target names) if given, else everything."""
    cmake = find_cmake()
    if cmake is None:
        raise CompileError("cmake is not installed", 'pip install "enginesmith[cuda]" (or pip install cmake ninja)')
    configure = [cmake, "-S", str(PLUGINS_DIR), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
                 f"-DENGINESMITH_BUILD_TRT_PLUGINS={'ON' if trt else 'OFF'}",
                 f"-DPython3_EXECUTABLE={sys.executable}"]
    ninja = find_ninja()
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    nvcc = find_nvcc()
    if nvcc and not os.environ.get("CUDACXX"):
        configure.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    if tensorrt_root:
        configure.append(f"-DTENSORRT_ROOT={tensorrt_root}")
    build = [cmake, "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2)]
    targets = list(targets)
    return [configure, build + (["--target", *targets] if targets else [])]


def _first_error(log: str) -> str:
    """The first line of the log that reads like an error (for the one-line message)."""
    for line in log.splitlines():
        if re.search(r"\berror\b|CMake Error|fatal", line, re.IGNORECASE):
            return line.strip()[:200]
    tail = [line.strip() for line in log.splitlines() if line.strip()]
    return tail[-1][:200] if tail else "no output"


def run_cmake(build_dir: Path, archs: tuple[str, ...], trt: bool = False, tensorrt_root: str | None = None,
              jobs: int | None = None, log_path: Path | None = None, targets: Iterable[str] = ()) -> str:
    """Configure and build plugins/ into `build_dir` (only `targets` if given); returns the combined
    log. A CompileError (one line, naming the log file) when a tool is missing or a step fails."""
    if find_nvcc() is None:
        raise CompileError("nvcc (the CUDA compiler) is not found",
                           "install the CUDA toolkit (12.8 or newer) and put nvcc on PATH, or set CUDACXX")
    if trt and find_tensorrt_headers(tensorrt_root) is None:
        raise CompileError("the TensorRT headers (NvInferRuntime.h) are not found",
                           "set TENSORRT_ROOT to a TensorRT install whose include/ holds them, or drop --trt")
    log = ""
    for cmd in cmake_commands(build_dir, ";".join(archs), trt, tensorrt_root, jobs, targets):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log += f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n"
        if log_path is not None:
            log_path.write_text(log)
        if proc.returncode != 0:
            first = _first_error(proc.stdout + proc.stderr)
            raise CompileError(f"compiling enginesmith's CUDA libraries failed: {first}",
                               f"see {log_path or 'the cmake output'}; `enginesmith doctor` checks nvcc, cmake "
                               "and the compiler")
    return log


@contextlib.contextmanager
def _locked(path: Path, what: str, progress: bool) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if missing); say so when waiting for another."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"enginesmith: waiting for another process compiling {what} ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def library_names(trt: bool = False) -> tuple[str, ...]:
    """What `enginesmith plugins build` makes: the ops and kernels libraries, with `trt` the TensorRT plugins."""
    return ("ort_ops", "kernels") + (("trt_plugins",) if trt else ())


def holds(entry: Path, names: Iterable[str]) -> bool:
    """Whether cache entry `entry` holds every library of `names`, each moved in and recorded in meta.json."""
    meta = entry_meta(entry / "meta.json")
    recorded = meta.get("libraries", ()) if meta else ()
    return meta is not None and all(LIBRARIES[n] in recorded and (entry / LIBRARIES[n]).is_file() for n in names)


def build_cached(archs: tuple[str, ...], trt: bool = False, tensorrt_root: str | None = None,
                 jobs: int | None = None, force: bool = False, progress: bool = True,
                 names: Iterable[str] | None = None) -> Path:
    """The cache entry for (sources, archs, ONNX Runtime[, TensorRT]) holding libraries `names`
    (default: library_names(trt)); those it lacks are compiled first, only their CMake targets (with
    `force`, all of `names` again). One lock per key: who waits finds what the other compiled."""
    names = tuple(names or library_names(trt))
    root = kernels_cache()
    key = cache_key(archs, trt)
    final = root / key
    if holds(final, names) and not force:
        return final
    with writing_to(root, "the compiled CUDA libraries", gb=1):
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f".{key}.lock", f"the CUDA libraries for sm_{'/'.join(archs)}", progress):
            todo = [n for n in names if force or not holds(final, (n,))]
            if todo:  # else another process compiled them while this one waited
                _grow_entry(final, archs, todo, trt, tensorrt_root, jobs, progress)
    return final


def _grow_entry(final: Path, archs: tuple[str, ...], names: list[str], trt: bool, tensorrt_root: str | None,
                jobs: int | None, progress: bool) -> None:
    """Compile the CMake targets of `names` in the key's build folder (kept until the entry holds every
    library: the next target reuses the objects they share), then rename each library into `final`
    and record it in meta.json (written aside, renamed). The caller holds the key's lock."""
    root, key = final.parent, final.name
    build, log_path = root / f".{key}.build", root / f"{key}.log"
    targets, sm = [TARGETS[n] for n in names], "sm_" + "/".join(archs)
    if progress:
        print(f"enginesmith: compiling the {' and '.join(DESCRIPTIONS[n] for n in names)} ({', '.join(targets)}) "
              f"for {sm} once; cached in {final}", file=sys.stderr, flush=True)
    started = time.time()
    try:
        log = run_cmake(build, archs, trt, tensorrt_root, jobs, log_path, targets)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)  # a failed configure must not stick (a cached wrong compiler)
        raise
    seconds = round(time.time() - started, 1)
    meta = entry_meta(final / "meta.json") or {}
    recorded = meta.get("libraries", {})
    libraries = recorded if isinstance(recorded, dict) else {lib: {} for lib in recorded}  # older entries: a list
    meta.update(sources_sha256=sources_sha256(), archs=list(archs), trt=trt, onnxruntime=onnxruntime_version(),
                cmake=tool_version(find_cmake()), nvcc=tool_version(find_nvcc()), cusparselt="cuSPARSELt=ON" in log)
    final.mkdir(exist_ok=True)
    for name in names:
        lib = LIBRARIES[name]
        _replace(final / lib, lambda tmp, lib=lib: shutil.copy2(build / lib, tmp))
        libraries[lib] = {"target": TARGETS[name], "seconds": seconds,
                          "compiled": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    meta["libraries"] = libraries
    _replace(final / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
    log_path.unlink(missing_ok=True)
    if holds(final, library_names(trt)):
        shutil.rmtree(build, ignore_errors=True)
    if progress:
        print(f"enginesmith: compiled {', '.join(targets)} for {sm} in {seconds:.0f} s", file=sys.stderr, flush=True)


def _replace(path: Path, write) -> None:
    """Write `path` through `write(tmp)` into a temp name beside it, then rename it over `path`: readers
    see the old file or the new one, never half of one (a process that loaded the old library keeps it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_into(build_dir: Path, archs: tuple[str, ...], trt: bool = False, tensorrt_root: str | None = None,
               jobs: int | None = None, progress: bool = True) -> Path:
    """Configure and build in place into `build_dir` ($ENGINESMITH_PLUGINS_BUILD: incremental, not
    cached); returns the folder."""
    with writing_to(build_dir, "the CUDA libraries' build", fix=f"point {BUILD_ENV} at a writable folder"):
        build_dir.mkdir(parents=True, exist_ok=True)
        what = " and ".join(DESCRIPTIONS[n] for n in library_names(trt))
        if progress:
            print(f"enginesmith: compiling the {what} for sm_{'/'.join(archs)} in {build_dir}",
                  file=sys.stderr, flush=True)
        started = time.time()
        run_cmake(build_dir, archs, trt, tensorrt_root, jobs, build_dir / "enginesmith-build.log")
        if progress:
            print(f"enginesmith: compiled in {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    return build_dir


def entry_meta(path: Path) -> dict | None:
    """meta.json beside `path` (a library of a cache entry or of plugins/prebuilt/, or meta.json
    itself), or None (no such file, unreadable)."""
    try:
        meta = json.loads((path.parent / "meta.json").read_text())
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def stale_sources(library: Path) -> list[Path]:
    """Sources newer than `library` (for builds outside the cache, whose key cannot say it)."""
    try:
        built = library.stat().st_mtime
    except OSError:
        return []
    return [p for p in source_files() if p.stat().st_mtime > built]


def build_dir_archs(library: Path) -> str | None:
    """CMAKE_CUDA_ARCHITECTURES of the CMake build folder holding `library`, or None."""
    try:
        text = (library.parent / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^CMAKE_CUDA_ARCHITECTURES:\w+=(.*)$", text, re.MULTILINE)
    return m.group(1).strip() if m else None
