"""`enginesmith doctor`: what this machine has for enginesmith, and the fix for each missing piece.

It reports the GPU (name, compute capability, driver, CUDA), torch, the ONNX Runtime flavour and its
providers, the state of the compiled libraries (where, for which arch, stale or not), TensorRT, and
the build tools (nvcc, cmake, ninja, a C++ compiler). It only looks: nothing is installed or compiled,
and it exits 0 whatever it finds (a CPU-only machine is a fine machine for --device cpu).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from enginesmith import __version__
from enginesmith.core import onnxruntime_flavour
from enginesmith.plugins import compile as plugin_compile

# Status words, in the order a reader cares: ok, a warning (works, but not as intended), missing
# (absent, fine for some uses), error (something that makes enginesmith fail), info.
OK, WARN, MISSING, ERROR, INFO = "ok", "warn", "missing", "error", "info"


@dataclass
class Check:
    name: str
    status: str
    value: str
    fix: str = ""
    details: dict = field(default_factory=dict)


def _run(cmd: list[str], timeout: float = 30) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _torch():
    """torch if it imports, else None (doctor must run even where torch is broken)."""
    try:  # deferred on purpose: slow to import, and doctor reports its absence instead of failing
        import torch

        return torch
    except Exception:
        return None


def check_enginesmith() -> Check:
    where = Path(__file__).resolve().parents[1]  # the enginesmith package (this file is enginesmith/cli/doctor.py)
    return Check("enginesmith", OK, f"{__version__} (Python {platform.python_version()}, {where})",
                 details={"version": __version__, "python": sys.executable, "package": str(where)})


def check_gpu(gpu: plugin_compile.Gpu | None) -> Check:
    smi = shutil.which("nvidia-smi")
    cuda = None
    if smi:
        m = re.search(r"CUDA Version:\s*([\d.]+)", _run([smi]) or "")
        cuda = m.group(1) if m else None
    if gpu is None:
        why = "nvidia-smi is not installed" if smi is None else "nvidia-smi lists no GPU"
        return Check("GPU", MISSING, f"no NVIDIA GPU found ({why}; torch sees none)",
                     "none needed for --device cpu; for CUDA, a machine with an NVIDIA GPU and its driver "
                     "(nvidia-smi comes with the driver)", {"gpu": None})
    cap = f"{gpu.arch[:-1]}.{gpu.arch[-1]}"
    driver = f", driver {gpu.driver}" if gpu.driver else ""
    cuda_text = f", CUDA {cuda} (driver's)" if cuda else ""
    status, fix = OK, ""
    if int(re.sub(r"\D", "", gpu.arch)) < plugin_compile.MIN_ARCH:
        status, fix = WARN, (f"enginesmith's CUDA kernels need sm_{plugin_compile.MIN_ARCH} or newer; "
                             "use ONNX Runtime's own ops (--custom-ops off)")
    return Check("GPU", status, f"{gpu.name}, sm_{gpu.arch} (compute capability {cap}){driver}{cuda_text}", fix,
                 {"name": gpu.name, "arch": gpu.arch, "compute_capability": cap, "driver": gpu.driver,
                  "driver_cuda": cuda, "found_by": gpu.source})


def check_torch(gpu: plugin_compile.Gpu | None) -> Check:
    torch = _torch()
    if torch is None:
        return Check("torch", ERROR, "not importable", "pip install torch (enginesmith needs it to export models)")
    cuda = torch.version.cuda
    usable = torch.cuda.is_available()
    value = f"{torch.__version__}, " + (f"CUDA {cuda} build" if cuda else "CPU build")
    details = {"version": torch.__version__, "cuda": cuda, "cuda_available": usable}
    if gpu is not None and not usable:
        fix = ("a CPU build of torch on a GPU machine: install a CUDA build (pip install torch from the CUDA index)"
               if not cuda else "torch cannot use the GPU: check the driver (nvidia-smi) against torch's CUDA")
        return Check("torch", WARN, value + ", sees no GPU", fix, details)
    return Check("torch", OK, value + (", GPU usable" if usable else ""), details=details)


def check_onnxruntime(gpu: plugin_compile.Gpu | None) -> list[Check]:
    install = onnxruntime_flavour.inspect()
    notes = [Check("ONNX Runtime", INFO, note) for note in install.notes]
    if install.problem:
        what, fix = install.problem
        status = MISSING if install.module_dir is None else ERROR
        return [Check("ONNX Runtime", status, what, fix)] + notes
    details: dict = {"distribution": install.distribution, "version": install.version,
                     "flavour": install.flavour, "location": str(install.module_dir)}
    try:  # deferred on purpose: importing ONNX Runtime is the check itself
        import onnxruntime

        providers = list(onnxruntime.get_available_providers())
        version = onnxruntime.__version__
    except Exception as exc:  # a broken install is what doctor is for
        return [Check("ONNX Runtime", ERROR, f"{install.distribution} does not import: {type(exc).__name__}: {exc}",
                      onnxruntime_flavour.MIXED_FIX, details)] + notes
    details.update(providers=providers, version=version)
    short = ", ".join(p.removesuffix("ExecutionProvider") for p in providers)
    value = f"{version} ({install.distribution}, flavour {install.flavour}), providers: {short}"
    status, fix = OK, ""
    if gpu is not None and "CUDAExecutionProvider" not in providers:
        status, fix = WARN, 'pip uninstall -y onnxruntime && pip install "enginesmith[cuda]" (the CUDA flavour)'
    elif gpu is None and install.flavour == "cuda":
        status, fix = INFO, "the CUDA flavour runs on the CPU too; no GPU here to use it"
    return [Check("ONNX Runtime", status, value, fix, details)] + notes


ORIGINS = {"env": "named by the environment", "build-dir": "in $ENGINESMITH_PLUGINS_BUILD",
           "checkout": "built by hand in plugins/build", "wheel": "shipped in the wheel",
           "cache": "compiled into the cache"}


def check_library(name: str, gpu: plugin_compile.Gpu | None) -> Check:
    label = {"ort_ops": "ops library", "kernels": "kernels library", "trt_plugins": "TensorRT plugins"}[name]
    where = plugin_compile.locate(name, any_arch=True)
    if where is None or not where.built:
        return _library_not_built(name, label, where, gpu)
    details: dict = {"path": str(where.path), "origin": where.origin}
    meta = plugin_compile.entry_meta(where.path) if where.origin in ("cache", "wheel") else None
    archs = ";".join(meta.get("archs", [])) if meta else plugin_compile.build_dir_archs(where.path)
    details["archs"] = archs
    value = f"{where.path} ({ORIGINS[where.origin]}" + (f", sm {archs}" if archs else "") + ")"
    status, fix = OK, ""
    if where.origin not in ("cache", "wheel"):  # their meta holds the sources' hash: they cannot be stale
        newer = plugin_compile.stale_sources(where.path)
        details["stale_sources"] = [str(p) for p in newer[:5]]
        if newer:
            status, fix = WARN, (f"stale: {len(newer)} source file(s) are newer than it; rebuild it "
                                 "(or unset the variable, remove it, to use the cache)")
    if gpu is not None and archs and status == OK and not plugin_compile.arch_covers(re.split(r"[;,\s]+", archs),
                                                                                        gpu.arch):
        status, fix = WARN, f"built for sm {archs}, the GPU is sm_{gpu.arch}: enginesmith plugins build"
    return Check(label, status, value, fix, details)


def _library_not_built(name: str, label: str, where: plugin_compile.Located | None,
                       gpu: plugin_compile.Gpu | None) -> Check:
    """The check of a library that is not there: an error if a variable names a missing file, else
    what will happen (compiled on first use, or on request) and, with a GPU, how to do it now."""
    lib = plugin_compile.LIBRARIES[name]
    trt = name == "trt_plugins"
    build = "enginesmith plugins build" + " --trt" * trt
    needs = " (needs TENSORRT_ROOT; only for --backend trt)" if trt else ""
    if where is not None and where.origin in ("env", "build-dir"):
        return Check(label, ERROR, f"{where.path} not found (named by the environment)",
                     f"build it there, or unset the variable and run `{build}`{needs}", {"path": str(where.path)})
    when = "built on request" if trt else "compiled on first use"
    if gpu is None or where is None:  # nothing to do on this machine: --device cpu needs none of them
        how = (f"`{build}` builds it, for --backend trt only" if trt else
               "compiled on first use on a machine with an NVIDIA GPU, or shipped in a binary wheel")
        return Check(label, INFO, f"not built ({lib}; {how}; --device cpu needs none)", "", {"path": None})
    shipped = plugin_compile.shipped_archs() if plugin_compile.wheel_library(name) else []
    wheel = f"; the wheel's is for sm {';'.join(shipped)}, not this GPU's sm_{gpu.arch}" if shipped else ""
    return Check(label, MISSING, f"not built yet ({when}: {where.path}{wheel})", f"`{build}` compiles it now{needs}",
                 {"path": str(where.path), "origin": where.origin, "wheel_archs": shipped})


def check_old_cache_entries() -> Check | None:
    """Cache entries of other sources (an older enginesmith): not used, only taking space."""
    root = plugin_compile.kernels_cache()
    try:
        old = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
               and not p.name.startswith(plugin_compile.sources_sha256()[:16])]
    except OSError:
        return None
    if not old:
        return None
    return Check("kernel cache", INFO, f"{len(old)} entr{'y' if len(old) == 1 else 'ies'} from other sources in {root}",
                 f"rm -rf {' '.join(str(p) for p in old[:3])}{' ...' if len(old) > 3 else ''} (unused)",
                 {"old": [str(p) for p in old]})


def check_tensorrt() -> list[Check]:
    checks = []
    if importlib.util.find_spec("tensorrt") is None:
        checks.append(Check("TensorRT", MISSING, "the Python package tensorrt is not installed",
                            "only for --backend trt: install TensorRT 10.15+ for your CUDA "
                            "(not on PyPI for every platform)"))
    else:
        try:  # deferred on purpose: importing TensorRT is the check
            import tensorrt

            checks.append(Check("TensorRT", OK, f"{tensorrt.__version__} importable",
                                details={"version": tensorrt.__version__}))
        except Exception as exc:
            try:
                version = importlib.metadata.version("tensorrt")
            except importlib.metadata.PackageNotFoundError:
                version = "?"
            checks.append(Check("TensorRT", ERROR, f"tensorrt {version} is installed but does not import: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                "reinstall TensorRT for this CUDA version, or ignore it if you use ONNX Runtime"))
    headers = plugin_compile.find_tensorrt_headers()
    checks.append(Check("TensorRT headers", OK if headers else MISSING,
                        str(headers) if headers else "NvInferRuntime.h not found ($TENSORRT_ROOT unset or wrong)",
                        "" if headers else
                        "only for `enginesmith plugins build --trt`: set TENSORRT_ROOT to a TensorRT install"))
    return checks


def check_tools() -> list[Check]:
    nvcc = plugin_compile.find_nvcc()
    cmake = plugin_compile.find_cmake()
    ninja = plugin_compile.find_ninja()
    cxx = shutil.which("c++") or shutil.which("g++")
    pypi = 'pip install "enginesmith[cuda]" (brings cmake and ninja from PyPI)'

    def tool(name: str, path: str | None, fix: str, status_missing: str = MISSING, flag: str = "--version") -> Check:
        if path is None:
            return Check(name, status_missing, "not found", fix)
        version = plugin_compile.tool_version(path, flag)
        return Check(name, OK, f"{version or '?'} ({path})", details={"path": path, "version": version})

    return [tool("nvcc", nvcc, "needed to compile the CUDA libraries: install the CUDA toolkit (12.8+) and put nvcc "
                               "on PATH, or set CUDACXX"),
            tool("cmake", cmake, pypi),
            tool("ninja", ninja, pypi + "; without it CMake uses make, slower"),
            tool("C++ compiler", cxx, "apt-get install g++ (nvcc needs a host compiler)")]


def checks() -> list[Check]:
    gpu = plugin_compile.detect_gpu()
    result = [check_enginesmith(), check_gpu(gpu), check_torch(gpu)]
    result += check_onnxruntime(gpu)
    result += [check_library("ort_ops", gpu), check_library("kernels", gpu), check_library("trt_plugins", gpu)]
    old = check_old_cache_entries()
    if old:
        result.append(old)
    result += check_tensorrt()
    result += check_tools()
    return result


def format_text(found: list[Check]) -> str:
    marks = {OK: "ok", WARN: "WARN", MISSING: "--", ERROR: "ERROR", INFO: "info"}
    width = max(len(c.name) for c in found)
    lines = []
    for c in found:
        lines.append(f"{marks[c.status]:<6} {c.name:<{width}}  {c.value}")
        if c.fix:
            lines.append(f"{'':<6} {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def as_json(found: list[Check]) -> dict:
    return {"checks": [asdict(c) for c in found],
            "problems": sum(c.status in (ERROR, WARN) for c in found)}


def add_parser(verbs) -> None:
    p = verbs.add_parser("doctor", help="what this machine has for enginesmith (GPU, ONNX Runtime, CUDA ops, "
                                        "TensorRT, compilers), with the fix for each missing piece")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    found = checks()
    print(json.dumps(as_json(found)) if args.json else format_text(found))
    return 0  # doctor reports; a missing piece is a line with its fix, not a failure
