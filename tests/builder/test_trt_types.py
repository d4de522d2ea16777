"""mypy over the TensorRT code, against the tensorrt 10.13 stubs ($ENGINESMITH_TRT_STUBS, see tests/helpers/external.py).

TensorRT cannot be installed here, so this type check is what stands between the builder/runner and
a typo in an API call. The package is mapped from its folders (export/ -> enginesmith.export, ...),
which mypy cannot follow through the editable install, so the test links an `enginesmith` tree in
a temp dir and points mypy at it. torch and transformers are treated as untyped (checking their
stubs takes minutes); numpy, onnx and tensorrt are checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.external import TRT_STUBS, require_module

REPO = Path(__file__).resolve().parents[2]
# paths inside the installed package (enginesmith/<here>), and where each lies in the repository
CHECKED = {"runtime/engines/trt_engine.py": "runtime/engines/trt_engine.py",
           "builder/trt_lint.py": "enginesmith/builder/trt_lint.py",
           "builder/trt_ops.py": "enginesmith/builder/trt_ops.py", "builder/jetson.py": "enginesmith/builder/jetson.py",
           "builder/trt.py": "enginesmith/builder/trt.py", "builder/trt_plan.py": "enginesmith/builder/trt_plan.py",
           "core/tensorrt.py": "enginesmith/core/tensorrt.py", "serving/triton_repository.py": "enginesmith/serving/triton_repository.py",
           "serving/triton_model.py": "enginesmith/serving/triton_model.py"}

MYPY_INI = """\
[mypy]
mypy_path = {stubs}:{src}
python_version = 3.10
follow_imports = silent
check_untyped_defs = True
warn_unused_ignores = True
warn_redundant_casts = True
no_implicit_optional = True
cache_dir = {cache}

[mypy-enginesmith.runtime.engines.trt_engine,enginesmith.serving.*,enginesmith.core.tensorrt,enginesmith.builder.trt,enginesmith.builder.trt_plan,enginesmith.builder.trt_lint,enginesmith.builder.trt_ops,enginesmith.builder.jetson]
disallow_untyped_defs = True
disallow_incomplete_defs = True

[mypy-tensorrt.*]
ignore_errors = True
[mypy-tensorrt_bindings.*]
ignore_errors = True
[mypy-torch.*,transformers.*,tritonclient.*,triton_python_backend_utils,google.protobuf.*]
follow_imports = skip
ignore_missing_imports = True
"""


def linked_tree(root: Path) -> Path:
    """root/enginesmith/... mirroring the installed package layout with symlinks to the sources."""
    pkg = root / "enginesmith"
    pkg.mkdir(parents=True)
    for f in (REPO / "enginesmith").iterdir():
        if f.suffix == ".py" or (f.is_dir() and f.name != "__pycache__"):
            (pkg / f.name).symlink_to(f)
    for sub in ("runtime", "export", "models", "passes", "plugins"):
        if (REPO / sub).is_dir():
            (pkg / sub).symlink_to(REPO / sub)
    return root


@pytest.fixture
def mypy_api():
    return require_module("mypy.api", "pip install mypy (a test extra)")


@pytest.fixture
def stubs() -> Path:
    return TRT_STUBS.require()


def test_tensorrt_code_is_mypy_clean(mypy_api, stubs, tmp_path):
    src = linked_tree(tmp_path / "src")
    cache = Path(os.environ.get("ENGINESMITH_MYPY_CACHE", tmp_path / "mypy_cache"))
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI.format(stubs=stubs, src=src, cache=cache))
    files = [str(src / "enginesmith" / f) for f, repo in CHECKED.items() if (REPO / repo).exists()]
    stdout, stderr, status = mypy_api.run(["--config-file", str(ini), *files])
    assert status == 0, f"mypy found problems:\n{stdout}{stderr}"


def test_mypy_sees_the_tensorrt_stubs(mypy_api, stubs, tmp_path):
    """A wrong call against the stubs must fail: proof the check is not vacuous (tensorrt not Any)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import tensorrt as trt\n"
                   "def f(engine: trt.ICudaEngine) -> None:\n"
                   "    ctx = engine.create_execution_context()\n"
                   "    ctx.execute_async_v4(0)\n"
                   "    ctx.set_tensor_address('x', 'not an int')\n")
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI.format(stubs=stubs, src=tmp_path, cache=tmp_path / "cache"))
    stdout, _, status = mypy_api.run(["--config-file", str(ini), str(bad)])
    assert status == 1
    assert "execute_async_v4" in stdout and "set_tensor_address" in stdout
