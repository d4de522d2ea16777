"""enginesmith.build: model source -> export -> passes -> engine directory.

    from enginesmith.build import BuildConfig, build
    build(BuildConfig(model="tiny:llama", quant="w4a16-rtn"), "engine-dir")

`engine` is the orchestration (one build path, the cached default engine, the CUDA lowering);
`trt`, `jetson`, `trt_lint` and `trt_ops` are the TensorRT target.
"""

from enginesmith.build.engine import GQA_IO, BuildConfig, build, cached_engine, lower_for_cuda

__all__ = ["GQA_IO", "BuildConfig", "build", "cached_engine", "lower_for_cuda"]
