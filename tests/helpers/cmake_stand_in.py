"""A stand-in for plugins/compile.py's run_cmake (CMake + nvcc) in the tests of the compile cache's
locking and growth and of the wheel hook's compile path, which would otherwise compile the CUDA
sources for minutes. It "links" each
requested target's library into the build folder and records the call; the real CMake path is tested
where the libraries are really compiled (tests/plugins/test_wheel.py's build, the GPU test of test_install.py).

Set in the environment, so that other processes (the CLI run by the tests) do the same:
    STAND_IN_CALLS    file: one line a call, "<build folder> <target> ..."
    STAND_IN_RELEASE  file (optional): wait for it to exist before "compiling" (after touching
                      <calls>.started), so a test can look at the cache while a compile is in flight
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def stand_in_run_cmake(build_dir: Path, archs, trt=False, tensorrt_root=None, jobs=None, log_path=None,
                       targets=()) -> str:
    calls = Path(os.environ["STAND_IN_CALLS"])
    calls.with_suffix(".started").touch()
    release = os.environ.get("STAND_IN_RELEASE")
    deadline = time.monotonic() + 300
    while release and not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    build_dir.mkdir(parents=True, exist_ok=True)
    for target in targets:
        (build_dir / f"lib{target}.so").write_bytes(b"stand-in " + target.encode())
    with open(calls, "a") as f:
        f.write(f"{build_dir} {' '.join(targets)}\n")
    return "cuSPARSELt=OFF"


LAUNCH_CLI = ("import sys\n"
              "sys.path.insert(0, {tests!r})\n"
              "from helpers.cmake_stand_in import stand_in_run_cmake\n"
              "from enginesmith.plugins import compile as plugin_compile\n"
              "plugin_compile.run_cmake = stand_in_run_cmake\n"
              "from enginesmith.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
