"""tests/helpers/external.py: a prerequisite outside the repository skips with its reason, or fails under the
strict switch; .ci/run turns the switch on and still runs exactly the README's test command."""

from __future__ import annotations

import re

import pytest

from helpers import external
from helpers.external import REPO, STRICT_ENV, TENSORRT, ExternalPath, require_module


def outcome(call) -> BaseException:
    """The skip or failure `call` raised, caught here so that a wrong skip cannot pass as a skipped test."""
    try:
        call()
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:
        return exc
    raise AssertionError(f"{call} neither skipped nor failed")


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")


def test_missing_path_skips_naming_what_where_and_the_variable(lenient, monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORRT_ROOT", str(tmp_path / "nowhere"))
    exc = outcome(TENSORRT.require)
    assert isinstance(exc, pytest.skip.Exception)
    msg = str(exc)
    assert f"TensorRT headers missing at {tmp_path / 'nowhere'}" in msg
    assert "the path comes from $TENSORRT_ROOT" in msg
    assert "fix: set TENSORRT_ROOT to the folder that holds include/NvInferRuntime.h" in msg


def test_strict_turns_the_skip_into_a_failure(strict, monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORRT_ROOT", str(tmp_path / "nowhere"))
    exc = outcome(TENSORRT.require)
    assert isinstance(exc, pytest.fail.Exception)
    assert str(exc).startswith(f"strict: TensorRT headers missing at {tmp_path / 'nowhere'}")


def test_strict_switch_values(monkeypatch):
    for value, on in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(STRICT_ENV, value)
        assert external.strict() is on, value
    monkeypatch.delenv(STRICT_ENV)
    assert not external.strict()


def test_present_path_is_returned_even_under_strict(strict, monkeypatch, tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "NvInferRuntime.h").write_text("// header\n")
    monkeypatch.setenv("TENSORRT_ROOT", str(tmp_path))
    assert TENSORRT.require() == tmp_path


def test_unset_variable_defaults_to_shared_beside_the_checkout(lenient, monkeypatch):
    probe = ExternalPath("probe", "ENGINESMITH_TEST_PROBE_DIR", "no/such/folder", "marker")
    monkeypatch.delenv(probe.env, raising=False)
    assert probe.path() == REPO.parent / "shared" / "no" / "such" / "folder"
    exc = outcome(probe.require)
    assert isinstance(exc, pytest.skip.Exception)
    assert "$ENGINESMITH_TEST_PROBE_DIR is not set, so ../shared" in str(exc)


def test_missing_module(lenient):
    exc = outcome(lambda: require_module("no_such_module_for_enginesmith", "pip install it"))
    assert isinstance(exc, pytest.skip.Exception)
    assert "Python module no_such_module_for_enginesmith is not installed" in str(exc) and "fix: pip install it" in str(exc)
    assert require_module("json", "part of Python").dumps([]) == "[]"


def test_missing_module_under_strict(strict):
    exc = outcome(lambda: require_module("no_such_module_for_enginesmith", "pip install it"))
    assert isinstance(exc, pytest.fail.Exception)
    assert str(exc).startswith("strict: Python module no_such_module_for_enginesmith")


def test_ci_runs_the_readme_command_with_the_strict_switch_and_paths():
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "python -m pytest" in line and "pip install" in line)
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.strip()]
    assert ci[-1] == command
    exports = dict(re.findall(r"^export (\w+)=(.*)$", "\n".join(ci[:-1]), re.M))
    assert exports[STRICT_ENV] == "1"
    assert exports["TENSORRT_ROOT"].endswith('/third_party/tensorrt"')
    assert exports["ENGINESMITH_TRT_STUBS"].endswith('/third_party/tensorrt/stubs-10.13"')
