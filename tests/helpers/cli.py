"""The real `enginesmith` command in a subprocess, and the check that a user's mistake ends in one line."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, env=None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "enginesmith.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = result.stderr.strip()
    assert result.returncode == code, (result.returncode, err)
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and "(fix: " in last, last
    for word in words:
        assert word in last, (word, last)
