"""The README's Python API example runs as written (in a temp directory, on a tiny random model)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_python_api_example_runs(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) == 1, "the README should hold exactly one Python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("fp32+w4a16-rtn 16 tokens: "), out
    assert (tmp_path / "tiny-w4" / "build.json").is_file()
