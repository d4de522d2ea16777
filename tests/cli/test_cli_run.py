"""`enginesmith run` and `chat` end to end through the real command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.cli import cli


@pytest.mark.slow
def test_default_run_answers_the_capital_of_france(smollm2_engine):
    # no --engine/--model: the cached default engine (built by the fixture, as on first use)
    result = cli("run", "What is the capital of France?", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_raw_continuation_and_batch(smollm2_engine):
    result = cli("run", "--engine", str(smollm2_engine), "--raw", "--max-tokens", "12",
                 "The capital of France is", "One, two, three,")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("\n[1] ")
    assert first.startswith("[0] The capital of France is Paris")
    assert second.startswith("One, two, three, four")
    # the padded batch gives what each prompt gives alone
    alone = cli("run", "--engine", str(smollm2_engine), "--raw", "--max-tokens", "12", "One, two, three,")
    assert alone.stdout.strip() == second.strip()


def test_chat_repl_streams_and_keeps_going(tiny_engine):
    proc = subprocess.run([sys.executable, "-m", "enginesmith.cli", "chat", "--engine", str(tiny_engine("llama")),
                           "--max-tokens", "5"], input="hello\n/reset\nhow are you?\n/exit\n",
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(">>> ") == 4  # a prompt before each of the four lines
    assert "Traceback" not in proc.stderr
