"""Loads the plugin Python modules (plugins/kernels.py, plugins/reference.py) for the tests, from
enginesmith.plugins when installed, else from the source tree by path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    try:  # installed as enginesmith.plugins once pyproject lists it
        return importlib.import_module(f"enginesmith.plugins.{name}")
    except ImportError:
        key = f"_es_plugins_{name}"
        if key in sys.modules:
            return sys.modules[key]
        spec = importlib.util.spec_from_file_location(key, REPO / "plugins" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
        return mod


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


import pytest  # noqa: E402

requires_gpu = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU: run on the GPU machine (device tool)")

kernels = load("kernels")
reference = load("reference")
