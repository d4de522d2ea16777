"""What the tests need from outside the repository, and the one rule for when it is missing.

On a user's machine a missing prerequisite (TensorRT headers or stubs, the default model, a test
tool) skips the tests that need it, with a reason that says what is missing and how to provide it.
With ENGINESMITH_TEST_STRICT=1 (set by .ci/run) the same miss fails them instead ("strict: ..."),
so CI cannot pass by skipping what it is meant to run. Skips that no machine of CI's kind can avoid
(no CUDA GPU, TensorRT not installable) are plain `skipif` marks and do not come through here.

Paths outside the repository come from an environment variable, else from the workplace layout:
a `shared/` folder beside the checkout (../shared/<rel>), which a user's clone does not have.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[2]
STRICT_ENV = "ENGINESMITH_TEST_STRICT"


def strict() -> bool:
    """True when a missing prerequisite must fail the test rather than skip it."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def missing(what: str, fix: str) -> NoReturn:
    """Skip the calling test (fail it under strict mode), saying what is missing and the fix. At a
    module's top level it skips the module (under strict: a collection error, which stops the run)."""
    if strict():
        pytest.fail(f"strict: {what} (fix: {fix}; {STRICT_ENV}=1 turns this skip into a failure)", pytrace=False)
    pytest.skip(f"{what} (fix: {fix})", allow_module_level=True)


@dataclass(frozen=True)
class ExternalPath:
    """A folder outside the repository: $env if set, else ../shared/<shared_rel> beside the checkout.
    `marker` (relative to the folder) must exist for the folder to count as present."""

    what: str
    env: str
    shared_rel: str
    marker: str

    def path(self) -> Path:
        given = os.environ.get(self.env)
        return Path(given) if given else REPO.parent / "shared" / self.shared_rel

    def require(self) -> Path:
        """The folder, or skip/fail (see `missing`) naming where it was looked for and the variable."""
        root = self.path()
        if (root / self.marker).exists():
            return root
        source = (f"the path comes from ${self.env}" if os.environ.get(self.env)
                  else f"${self.env} is not set, so ../shared beside the checkout was tried")
        missing(f"{self.what} missing at {root} (looked for {self.marker}; {source})",
                f"set {self.env} to the folder that holds {self.marker}")


TENSORRT = ExternalPath("TensorRT headers", "TENSORRT_ROOT", "third_party/tensorrt", "include/NvInferRuntime.h")
TRT_STUBS = ExternalPath("TensorRT 10.13 type stubs", "ENGINESMITH_TRT_STUBS", "third_party/tensorrt/stubs-10.13",
                         "tensorrt_bindings")


def require_module(name: str, install: str):
    """The imported module, or skip/fail saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"Python module {name} is not installed ({exc})", install)


def cuda_ready() -> bool:
    """onnxruntime-gpu and a CUDA GPU are here (the device machine); CI has neither."""
    try:
        import onnxruntime as ort  # deferred: the check itself must not fail where these are missing
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


# The GPU tests' skip (a plain mark: no CI machine has a GPU, so strict mode leaves it alone).
needs_cuda = pytest.mark.skipif(not cuda_ready(), reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")
