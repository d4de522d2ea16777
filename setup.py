"""Build hook (the rest of the configuration is pyproject.toml): with $ENGINESMITH_KERNEL_ARCHS set,
a wheel carries the compiled CUDA libraries in enginesmith/plugins/prebuilt/ (plugins/prebuilt.py says
how, and how $ENGINESMITH_PREBUILT_FROM reuses a build instead of compiling) and is tagged for the
platform. Without it the wheel is source-only, and an editable install never compiles anything."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: the wheel package's
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent


def _prebuilt_module():
    """plugins/prebuilt.py as enginesmith.plugins.prebuilt, from this source tree (the package-dir
    mapping of pyproject.toml, done by hand: nothing is installed yet)."""
    sys.path.insert(0, str(HERE))
    import enginesmith  # noqa: F401  (this tree's: HERE is first on sys.path)

    spec = importlib.util.spec_from_file_location("enginesmith.plugins", HERE / "plugins" / "__init__.py",
                                                  submodule_search_locations=[str(HERE / "plugins")])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return importlib.import_module("enginesmith.plugins.prebuilt")


class BuildPyWithKernels(build_py):
    """build_py, then the compiled libraries into build_lib when $ENGINESMITH_KERNEL_ARCHS asks."""

    def run(self):
        super().run()
        if not _binary():
            return
        if getattr(self, "editable_mode", False):  # setuptools >= 64 sets it for `pip install -e`
            print("enginesmith: an editable install compiles nothing ($ENGINESMITH_KERNEL_ARCHS ignored); "
                  "the libraries compile on first use or with `enginesmith plugins build`")
            return
        prebuilt = _prebuilt_module()
        dest = Path(self.build_lib) / "enginesmith" / "plugins" / "prebuilt"
        work = Path(self.get_finalized_command("build").build_temp)
        try:
            prebuilt.stage_from_environment(dest, work)
        except prebuilt.UserError as exc:  # one line, not the build backend's traceback
            raise SystemExit(f"error: {exc}") from None


def _binary() -> bool:
    return bool(os.environ.get("ENGINESMITH_KERNEL_ARCHS", "").strip())


class DistributionWithKernels(Distribution):
    """With compiled libraries inside, the package is platform-specific (installed into platlib)."""

    def has_ext_modules(self):
        return _binary() or super().has_ext_modules()


class BdistWheelForPlatform(bdist_wheel):
    """With compiled libraries inside, the wheel is for this platform: py3-none-linux_x86_64 (the
    libraries use no Python ABI), not py3-none-any."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(distclass=DistributionWithKernels,
      cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": BdistWheelForPlatform})
