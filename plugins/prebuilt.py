"""The compiled CUDA libraries a binary wheel carries: what setup.py's build hook puts in the wheel.

    ENGINESMITH_KERNEL_ARCHS="80;86;87;89;90" pip wheel .      (or python -m build --wheel)

puts enginesmith/plugins/prebuilt/ into the wheel: libenginesmith_ort_ops.so, libenginesmith_kernels.so
(and libenginesmith_trt_plugins.so when $TENSORRT_ROOT is set) compiled for those archs, and meta.json
(the archs, the sources' sha256, nvcc's version, each library's target and sha256). Installed from
such a wheel, plugins/compile.py's locate() finds them (origin "wheel") when they were compiled from the
installed sources for an arch that runs on the GPU; other GPUs compile on first use as before.

    ENGINESMITH_PREBUILT_FROM=DIR   take the libraries from DIR instead of compiling: a CMake build
                                    folder of these sources configured for exactly those archs, or a
                                    cache entry (its meta.json). Checked, never trusted: another
                                    source tree, other archs, stale or missing libraries are refused.

Without ENGINESMITH_KERNEL_ARCHS the wheel is source-only; an editable install never compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from enginesmith.core.errors import UserError
from enginesmith.plugins import compile as plugin_compile

ARCHS_ENV = "ENGINESMITH_KERNEL_ARCHS"
FROM_ENV = "ENGINESMITH_PREBUILT_FROM"
TRT_ENV = "TENSORRT_ROOT"


def requested_archs() -> tuple[str, ...] | None:
    """$ENGINESMITH_KERNEL_ARCHS as an arch tuple (CMake's spelling kept: "80-real;90"), None if unset."""
    text = os.environ.get(ARCHS_ENV, "").strip()
    if not text:
        return None
    try:
        return plugin_compile.parse_archs(text)
    except UserError as exc:
        raise UserError(f"{ARCHS_ENV}={text!r} is not a list of CUDA archs the kernels support ({exc.what})",
                        'e.g. ENGINESMITH_KERNEL_ARCHS="80;86;87;89;90" (sm_80 or newer)') from None


def stage_from_environment(dest: Path, work: Path, say=print) -> dict | None:
    """The build hook's step: with $ENGINESMITH_KERNEL_ARCHS set, fill `dest` (the wheel's
    enginesmith/plugins/prebuilt/) and return its meta; else None and nothing is touched. `work` is a
    scratch folder for compiling (the build's temp folder)."""
    archs = requested_archs()
    if archs is None:
        return None
    trt_root = os.environ.get(TRT_ENV) or None
    names = plugin_compile.library_names(trt=trt_root is not None)
    source = os.environ.get(FROM_ENV, "").strip()
    if source:
        folder, facts = checked_folder(Path(source).resolve(), archs, names)
        say(f"enginesmith: the wheel takes the CUDA libraries for sm {';'.join(archs)} from {folder}")
    else:
        folder, facts = compiled_folder(work, archs, names, trt_root, say)
    return stage(dest, folder, archs, names, facts)


def compiled_folder(work: Path, archs: tuple[str, ...], names: tuple[str, ...], trt_root: str | None,
                    say=print) -> tuple[Path, dict]:
    """Compile the targets of `names` for `archs` in `work`/enginesmith-kernels (run_cmake)."""
    build = work / "enginesmith-kernels"
    targets = [plugin_compile.TARGETS[n] for n in names]
    say(f"enginesmith: compiling {', '.join(targets)} for sm {';'.join(archs)} into the wheel ...")
    started = time.time()
    plugin_compile.run_cmake(build, archs, trt_root is not None, trt_root, None, build / "enginesmith-build.log",
                             targets)
    seconds = round(time.time() - started, 1)
    say(f"enginesmith: compiled in {seconds:.0f} s")
    return build, {"from": "compiled", "seconds": seconds,
                   "nvcc": plugin_compile.tool_version(plugin_compile.find_nvcc())}


def checked_folder(folder: Path, archs: tuple[str, ...], names: tuple[str, ...]) -> tuple[Path, dict]:
    """`folder` ($ENGINESMITH_PREBUILT_FROM) if it holds `names` compiled from these sources for exactly
    `archs`: a cache entry (meta.json) or a CMake build folder (CMakeCache.txt); else a UserError."""
    fix = f"point {FROM_ENV} at a build of these sources for {';'.join(archs)}, or unset it to compile"
    sources: list[Path] = []  # a CMake folder's sources, to compare times with (a cache entry's key has their hash)
    if (folder / "meta.json").is_file():
        meta = plugin_compile.entry_meta(folder / "meta.json") or {}
        built_for, sha = tuple(str(a) for a in meta.get("archs", [])), meta.get("sources_sha256")
        nvcc = meta.get("nvcc")
    elif (folder / "CMakeCache.txt").is_file():
        cache = (folder / "CMakeCache.txt").read_text(errors="replace")
        built_for = tuple(a for a in re.split(r"[;\s]+", _cmake_value(cache, "CMAKE_CUDA_ARCHITECTURES")) if a)
        home = Path(_cmake_value(cache, "CMAKE_HOME_DIRECTORY") or "/nonexistent")
        sha = plugin_compile.sources_sha256(home) if (home / "CMakeLists.txt").is_file() else None
        sources, nvcc = plugin_compile.source_files(home), _cmake_nvcc_version(folder)
    else:
        raise UserError(f"{FROM_ENV}={folder} is neither a CMake build folder nor a cache entry", fix)
    if set(built_for) != set(archs):
        raise UserError(f"{folder} was compiled for {';'.join(built_for) or 'no arch'}, "
                        f"{ARCHS_ENV} asks for {';'.join(archs)}", fix)
    if sha != plugin_compile.sources_sha256():
        raise UserError(f"{folder} was compiled from other sources than these (sha256 differs)", fix)
    for name in names:
        lib = folder / plugin_compile.LIBRARIES[name]
        if not lib.is_file():
            raise UserError(f"{folder} holds no {lib.name} ({plugin_compile.DESCRIPTIONS[name]})",
                            f"build its target {plugin_compile.TARGETS[name]} there, or unset {FROM_ENV}")
        if sources and _out_of_date(folder, lib, plugin_compile.TARGETS[name], sources):
            raise UserError(f"{lib} is out of date with its sources",
                            f"rebuild it (cmake --build {folder} --target {plugin_compile.TARGETS[name]}), "
                            f"or unset {FROM_ENV}")
    return folder, {"from": str(folder), "nvcc": nvcc}


def _out_of_date(folder: Path, lib: Path, target: str, sources: list[Path]) -> bool:
    """Whether `lib` of CMake build folder `folder` would be rebuilt: ninja's dry run where ninja built
    it (it knows each target's own sources), else any source newer than the library."""
    ninja = plugin_compile.find_ninja()
    if ninja and (folder / "build.ninja").is_file():
        proc = subprocess.run([ninja, "-C", str(folder), "-n", target], capture_output=True, text=True, timeout=300)
        return proc.returncode != 0 or "no work to do" not in proc.stdout
    return any(p.stat().st_mtime > lib.stat().st_mtime for p in sources)


def _cmake_value(cache: str, name: str) -> str:
    m = re.search(rf"^{name}:\w+=(.*)$", cache, re.MULTILINE)
    return m.group(1).strip() if m else ""


def _cmake_nvcc_version(folder: Path) -> str | None:
    """nvcc's version as CMake recorded it (CMakeFiles/<cmake>/CMakeCUDACompiler.cmake), or None."""
    for path in sorted(folder.glob("CMakeFiles/*/CMakeCUDACompiler.cmake")):
        m = re.search(r'set\(CMAKE_CUDA_COMPILER_VERSION "([\d.]+)"\)', path.read_text(errors="replace"))
        if m:
            return m.group(1)
    return None


def stage(dest: Path, folder: Path, archs: tuple[str, ...], names: tuple[str, ...], facts: dict) -> dict:
    """Copy `names` from `folder` into `dest` with meta.json; written beside and renamed, so a failure
    leaves no half-filled prebuilt folder. Returns the meta."""
    libraries = {}
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in names:
            lib = plugin_compile.LIBRARIES[name]
            shutil.copy2(folder / lib, tmp / lib)
            data = (tmp / lib).read_bytes()
            libraries[lib] = {"target": plugin_compile.TARGETS[name], "bytes": len(data),
                              "sha256": hashlib.sha256(data).hexdigest(),
                              "needs_cusparselt": b"libcusparseLt.so" in data}  # its NEEDED entry
        meta = {"archs": list(archs), "sources_sha256": plugin_compile.sources_sha256(), "libraries": libraries,
                "trt": "trt_plugins" in names, **facts,
                "onnxruntime": "any (the ops ask for ORT's C API 16)",
                "staged": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta
