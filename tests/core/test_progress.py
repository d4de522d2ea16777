"""Progress on stderr: one plain line per redraw in a log (no carriage returns, no escape codes), a build
prints one line per stage when stderr is not a terminal, and the pass list does not glue onto the bar."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from enginesmith.core import progress


def test_log_lines_turn_redraws_into_lines():
    out = io.StringIO()
    lines = progress.LogLines(out)
    lines.write("\rbuild: 0/4 [00:00] \x1b[A\rbuild: 1/4 [00:01] load model\n\r   \r")
    assert out.getvalue() == "build: 0/4 [00:00]\nbuild: 1/4 [00:01] load model\n"


def test_a_bar_in_a_log_writes_lines_at_most_every_interval(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert not progress.interactive()
    bar = progress.bar(total=1000, desc="work", unit="it")
    for _ in range(1000):
        bar.update(1)  # within LOG_INTERVAL: no line per update
    bar.close()
    text = err.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert 1 <= len(text.splitlines()) <= 3 and "1000/1000" in text.splitlines()[-1]


def test_build_logs_one_line_per_stage_when_stderr_is_a_file(tmp_path):
    env = {**os.environ, "ENGINESMITH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "enginesmith.cli", "build", "--model", "tiny:llama",
                           "--kv", "paged", "--out", str(tmp_path / "e")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    stages = [line for line in lines if line.startswith("build: ")]
    assert len(stages) >= 3 and stages[-1].endswith("done")
    # the pass manager's lines stand alone, not appended to a bar line
    passes = [line for line in lines if line.lstrip().startswith("[1/")]
    assert passes and all(not line.startswith("build: ") for line in passes)
