"""Shared by the streaming benchmarks: engines from the CLI's build cache, strict fp32 on CUDA,
the device's name, GPU memory of this process."""

from __future__ import annotations

import os
import platform
import subprocess


def strict_fp32_cuda() -> None:
    """ORT's CUDA EP allows TF32 matmuls by default; ask for plain fp32 (use_tf32=0)."""
    import onnxruntime as ort

    real = ort.InferenceSession
    if getattr(real, "_strict_fp32", False):
        return

    def session(path, sess_options=None, providers=None, **kwargs):
        providers = [(p[0], {**p[1], "use_tf32": 0}) if isinstance(p, tuple) and p[0] == "CUDAExecutionProvider"
                     else p for p in (providers or [])]
        return real(path, sess_options, providers=providers, **kwargs)

    session._strict_fp32 = True
    ort.InferenceSession = session


def open_engine(model: str | None, device: str, kv: str = "dense", sinks: int = 4, window: int = 1020,
                threads: int | None = None):
    from enginesmith.builder.engine import BuildConfig, cached_engine
    from enginesmith.runtime.load import open_engine as open_dir

    config = BuildConfig(model=model, kv_layout=kv, kv_sinks=sinks, kv_window=window)
    return open_dir(cached_engine(config, progress=False), device=device, threads=threads)


def device_name(device: str) -> str:
    if device == "cuda":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            return out.stdout.strip().splitlines()[0] + " (ONNX Runtime CUDA EP, fp32, TF32 off)"
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "CUDA GPU"
    from enginesmith.measure.speed import cpu_name

    return f"{cpu_name()} x{len(os.sched_getaffinity(0))} (ONNX Runtime CPU EP, {platform.machine()})"


def gpu_mib() -> float | None:
    """GPU memory held by this process (nvidia-smi), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(mib)
    return None
