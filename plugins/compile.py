"""Compile enginesmith's CUDA libraries on first use, into a per-machine cache.

The package ships plugins/' C++/CUDA sources and CMakeLists.txt as package data, so a wheel install
can build the libraries where they run: CMake and Ninja (the PyPI packages that `enginesmith[cuda]`
installs, else those on PATH) drive nvcc. A build goes to cache_dir()/kernels/<key>/, where the key
names the sources' sha256, the GPU arch(s) and the ONNX Runtime version, so a changed source, another
GPU or another ONNX Runtime gets its own entry and an entry never goes stale. Compiling happens in a
temp folder renamed into place when done, under a lock file, so two processes never compile the same
key twice and nobody sees half an entry.

Libraries (CMake targets of CMakeLists.txt):
    ort_ops      libenginesmith_ort_ops.so       ONNX Runtime custom ops (compiled on first use)
    kernels      libenginesmith_kernels.so       the plugin kernels behind a C API (compiled on first use)
    trt_plugins  libenginesmith_trt_plugins.so   TensorRT plugins (`enginesmith plugins build --trt` only:
                                                 needs the TensorRT headers, $TENSORRT_ROOT)

Where a library is looked for, first hit wins (the older variables keep working and win):
    1. its own variable, a file: $ENGINESMITH_ORT_OPS_LIB, $ENGINESMITH_KERNELS_LIB
    2. $ENGINESMITH_PLUGINS_BUILD, a CMake build folder (made by hand or by `enginesmith plugins build`)
    3. plugins/build/ of a source checkout, if it holds the library (plugins/README.md's cmake commands)
    4. the cache entry for this machine's GPU (compiled there on first use)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import inspect as inspect_onnxruntime
from enginesmith.core.paths import cache_dir, writing_to

PLUGINS_DIR = Path(__file__).resolve().parent
CHECKOUT_BUILD_DIR = PLUGINS_DIR / "build"
LIBRARIES = {
    "ort_ops": "libenginesmith_ort_ops.so",
    "kernels": "libenginesmith_kernels.so",
    "trt_plugins": "libenginesmith_trt_plugins.so",
}
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
        dirnames[:] = sorted(d for d in dirnames if d != "build" and not d.startswith((".", "__")))
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


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str            # "90" for compute capability 9.0
    driver: str | None   # driver version (nvidia-smi)
    source: str          # how it was found: "nvidia-smi" or "torch"


@lru_cache(maxsize=None)
def detect_gpu() -> Gpu | None:
    """The first visible NVIDIA GPU: nvidia-smi, else torch (when it is installed); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and re.fullmatch(r"\d+\.\d+", parts[1]):
                return Gpu(parts[0], parts[1].replace(".", ""), parts[2], "nvidia-smi")
        except (OSError, subprocess.SubprocessError):
            pass
    try:  # deferred on purpose: torch is optional here and slow to import
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return Gpu(torch.cuda.get_device_name(0), f"{major}{minor}", None, "torch")
    except Exception:  # a broken CUDA setup is reported as "no GPU" here; doctor says more
        pass
    return None


def parse_archs(text: str) -> tuple[str, ...]:
    """"90", "sm_90", "80,90", "90a" -> ("90",), ("80", "90"), ("90a",); a UserError for anything else."""
    items = [a.strip().lower().removeprefix("sm_").removeprefix("sm") for a in text.replace(";", ",").split(",")]
    archs: list[str] = []
    for item in items:
        m = re.fullmatch(r"(\d{2,3})(a?)", item)
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
    origin: str  # "env" (its own variable), "build-dir" ($ENGINESMITH_PLUGINS_BUILD), "checkout", "cache"

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
    module docstring. A variable that is set wins even when its file is missing. The cache entry is
    the one for this machine's GPU; without a GPU, `any_arch` takes any compiled entry for these
    sources (the ops' CPU kernels run anywhere), else there is none (None)."""
    lib = LIBRARIES[name]
    env = LIBRARY_ENV.get(name)
    if env and os.environ.get(env):
        return Located(Path(os.environ[env]), "env")
    if os.environ.get(BUILD_ENV):
        return Located(Path(os.environ[BUILD_ENV]) / lib, "build-dir")
    if (CHECKOUT_BUILD_DIR / lib).is_file():
        return Located(CHECKOUT_BUILD_DIR / lib, "checkout")
    gpu = detect_gpu()
    entries = _cache_entries((gpu.arch,)) if gpu else _cache_entries(None) if any_arch else []
    for entry in entries:
        if (entry / lib).is_file():
            return Located(entry / lib, "cache")
    if gpu:
        return Located(kernels_cache() / cache_key((gpu.arch,)) / lib, "cache")
    return None


def ensure(name: str, progress: bool = True) -> Path:
    """Library `name`'s path, compiled into the cache first if it is not there (for this machine's
    GPU). A variable that names a missing file, or a machine without a GPU and without a compiled
    entry, is a UserError that says what to do."""
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
    entry = build_cached((gpu.arch,), progress=progress)
    return entry / lib


# ----------------------------------------------------------------------------- tools

def _pip_tool(module: str, bin_dir: str, name: str) -> str | None:
    """`name` from the bin dir of the PyPI package `module` (enginesmith[cuda]), else from PATH."""
    try:
        tool = Path(getattr(importlib.import_module(module), bin_dir)) / name  # an optional package
        if tool.is_file():
            return str(tool)
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


def find_cmake() -> str | None:
    """cmake of the PyPI package `cmake`, else cmake on PATH."""
    return _pip_tool("cmake", "CMAKE_BIN_DIR", "cmake")


def find_ninja() -> str | None:
    """ninja of the PyPI package `ninja`, else ninja on PATH (without it CMake falls back to make)."""
    return _pip_tool("ninja", "BIN_DIR", "ninja")


def find_nvcc() -> str | None:
    """$CUDACXX, nvcc on PATH, $CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc."""
    env = os.environ.get("CUDACXX")
    if env and Path(env).is_file():
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def find_tensorrt_headers(root: str | None = None) -> Path | None:
    """The folder holding NvInferRuntime.h: `root` or $TENSORRT_ROOT (its include/), else the system's."""
    root = root or os.environ.get("TENSORRT_ROOT")
    places = [Path(root) / "include", Path(root)] if root else [Path("/usr/include/x86_64-linux-gnu"),
                                                                 Path("/usr/include"), Path("/usr/local/include")]
    return next((p for p in places if (p / "NvInferRuntime.h").is_file()), None)


def tool_version(path: str | None, flag: str = "--version") -> str | None:
    """The first version-looking number a tool prints (nvcc: its release), or None."""
    if not path:
        return None
    try:
        out = subprocess.run([path, flag], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out) or re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else None


# ----------------------------------------------------------------------------- compiling

def cmake_commands(build_dir: Path, archs: str, trt: bool, tensorrt_root: str | None = None,
                   jobs: int | None = None) -> list[list[str]]:
    """The configure and build commands for plugins/ into `build_dir` (archs: CMake's list, "80;90")."""
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
    return [configure, [cmake, "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2)]]


def _first_error(log: str) -> str:
    """The first line of the log that reads like an error (for the one-line message)."""
    for line in log.splitlines():
        if re.search(r"\berror\b|CMake Error|fatal", line, re.IGNORECASE):
            return line.strip()[:200]
    tail = [line.strip() for line in log.splitlines() if line.strip()]
    return tail[-1][:200] if tail else "no output"


def run_cmake(build_dir: Path, archs: tuple[str, ...], trt: bool = False, tensorrt_root: str | None = None,
              jobs: int | None = None, log_path: Path | None = None) -> str:
    """Configure and build plugins/ into `build_dir`; returns the combined log. A CompileError (one
    line, naming the log file) when a tool is missing or a step fails."""
    if find_nvcc() is None:
        raise CompileError("nvcc (the CUDA compiler) is not found",
                           "install the CUDA toolkit (12.8 or newer) and put nvcc on PATH, or set CUDACXX")
    if trt and find_tensorrt_headers(tensorrt_root) is None:
        raise CompileError("the TensorRT headers (NvInferRuntime.h) are not found",
                           "set TENSORRT_ROOT to a TensorRT install whose include/ holds them, or drop --trt")
    log = ""
    for cmd in cmake_commands(build_dir, ";".join(archs), trt, tensorrt_root, jobs):
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


def build_cached(archs: tuple[str, ...], trt: bool = False, tensorrt_root: str | None = None,
                 jobs: int | None = None, force: bool = False, progress: bool = True) -> Path:
    """The cache entry for (sources, archs, ONNX Runtime[, TensorRT]), compiled first unless it is
    there (or with `force`, compiled again). Atomic: a temp folder renamed into place, under a lock."""
    root = kernels_cache()
    key = cache_key(archs, trt)
    final = root / key
    if (final / "meta.json").is_file() and not force:
        return final
    with writing_to(root, "the compiled CUDA libraries", gb=1):
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f".{key}.lock", f"the CUDA libraries for sm_{'/'.join(archs)}", progress):
            if (final / "meta.json").is_file() and not force:
                return final  # another process compiled it while this one waited
            work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
            try:
                log_path = root / f"{key}.log"
                started = time.time()
                if progress:
                    print(f"enginesmith: compiling the CUDA libraries for sm_{'/'.join(archs)} once "
                          f"(one to a few minutes); cached in {final}", file=sys.stderr, flush=True)
                log = run_cmake(work / "build", archs, trt, tensorrt_root, jobs, log_path)
                out = work / "out"
                out.mkdir()
                built = [lib for lib in LIBRARIES.values() if (work / "build" / lib).is_file()]
                for lib in built:
                    shutil.copy2(work / "build" / lib, out / lib)
                seconds = round(time.time() - started, 1)
                meta = {"sources_sha256": sources_sha256(), "archs": list(archs), "trt": trt,
                        "onnxruntime": onnxruntime_version(), "libraries": built, "seconds": seconds,
                        "cmake": tool_version(find_cmake()), "nvcc": tool_version(find_nvcc()),
                        "cusparselt": "cuSPARSELt=ON" in log,
                        "compiled": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
                if final.exists():  # --force: move the old entry aside (a process may have it loaded)
                    os.rename(final, work / "old")
                os.rename(out, final)
                log_path.unlink(missing_ok=True)
                if progress:
                    print(f"enginesmith: compiled in {seconds:.0f} s", file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return final


def build_into(build_dir: Path, archs: tuple[str, ...], trt: bool = False, tensorrt_root: str | None = None,
               jobs: int | None = None, progress: bool = True) -> Path:
    """Configure and build in place into `build_dir` ($ENGINESMITH_PLUGINS_BUILD: incremental, not
    cached); returns the folder."""
    with writing_to(build_dir, "the CUDA libraries' build", fix=f"point {BUILD_ENV} at a writable folder"):
        build_dir.mkdir(parents=True, exist_ok=True)
        if progress:
            print(f"enginesmith: compiling the CUDA libraries for sm_{'/'.join(archs)} in {build_dir}",
                  file=sys.stderr, flush=True)
        run_cmake(build_dir, archs, trt, tensorrt_root, jobs, build_dir / "enginesmith-build.log")
    return build_dir


def entry_meta(path: Path) -> dict | None:
    """meta.json of the cache entry holding library `path`, or None (not a cache entry, unreadable)."""
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
