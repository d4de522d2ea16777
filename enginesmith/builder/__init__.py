"""enginesmith.builder: model source -> export -> passes -> engine directory.

    from enginesmith.builder import BuildConfig, build
    build(BuildConfig(model="tiny:llama", quant="w4a16-rtn"), "engine-dir")
    build(BuildConfig(model="tiny:llama", target="ort-cuda", dtype="fp16", quant="w4a16-rtn"), "cuda-dir")

`config` holds one BuildConfig per target (ort-cpu, ort-cuda, trt), validated once; `pipeline` its one
step list, typed (`steps`); `manifest` what build.json records; `engine` the orchestration: one build
path, the cached default engine; `trt` (the glue), `trt_plan` (the builder), `jetson`, `trt_lint` and
`trt_ops` are the TensorRT target.
"""

from enginesmith.builder.engine import GQA_IO, TARGETS, BuildConfig, build, cached_engine
from enginesmith.builder.pipeline import steps

__all__ = ["GQA_IO", "TARGETS", "BuildConfig", "build", "cached_engine", "steps"]
