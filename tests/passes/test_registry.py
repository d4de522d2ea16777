"""Pass names, typed parameters, typed steps, pipeline text and presets (no graphs needed)."""

from __future__ import annotations

import pytest

from enginesmith.core.errors import UserError
from enginesmith.passes import PRESETS, build_pipeline, parse_pipeline, passes, preset_steps, typed_step
from enginesmith.passes.manager.steps import calibrated_steps


def test_parse_pipeline_names_params_and_types():
    steps = parse_pipeline("smoothquant:alpha=0.75,search=true,quantize_w8a8")
    assert [s.name for s in steps] == ["smoothquant", "quantize_w8a8"]
    assert steps[0].params.alpha == 0.75 and steps[0].params.search is True
    assert steps[1].params.include_lm_head is False
    colon = parse_pipeline("awq:block_size=64:grid=10, quantize_w4a16:block_size=64")
    assert colon[0].params.block_size == 64 and colon[0].params.grid == 10
    assert colon[1].spec() == "quantize_w4a16:block_size=64"


def test_spec_roundtrip():
    for text in ("smoothquant:alpha=0.8,through_v=false", "lower_ort:accuracy_level=4", "quantize_w8a8"):
        steps = parse_pipeline(text)
        assert ",".join(s.spec() for s in steps) == text
        assert parse_pipeline(",".join(s.spec() for s in steps)) == steps


@pytest.mark.parametrize("text, words", [
    ("smoothquant:alpha=1.5", "outside [0, 1]"),
    ("smoothquant:alpha=-0.1", "outside [0, 1]"),
    ("smoothquant:alpha=high", "not a valid float"),
    ("smoothquant:beta=0.5", "no parameter 'beta'"),
    ("quantise_w8a8", "unknown pass"),
    ("quantize_w4a16:block_size=100", "block_size=100"),
    ("awq:grid=0", "grid=0"),
    ("lower_ort:accuracy_level=7", "accuracy_level=7"),
    ("smoothquant:search=maybe", "not a valid bool"),
    ("alpha=0.5", "starts with a parameter"),
    ("", "empty"),
])
def test_bad_pipelines_are_user_errors(text, words):
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")) as err:
        parse_pipeline(text)
    assert err.value.fix  # every error says what to do


def test_typed_steps_are_the_steps_their_text_would_be():
    """A step built in code from typed values equals the one parsed from its text, field types too."""
    for step, text in ((typed_step("kv_ring", sinks=0, window=64), "kv_ring:sinks=0,window=64"),
                       (typed_step("smoothquant", alpha=1, search=False), "smoothquant:alpha=1.0"),
                       (typed_step("quantize_w4a16", block_size=64, include_lm_head=True),
                        "quantize_w4a16:block_size=64,include_lm_head=true"),
                       (typed_step("matmul_transb"), "matmul_transb")):
        assert step.spec() == text and [step] == parse_pipeline(text)
        assert {k: type(v) for k, v in vars(step.params).items()} == \
            {k: type(v) for k, v in vars(parse_pipeline(text)[0].params).items()}
    assert type(typed_step("smoothquant", alpha=1).params.alpha) is float  # an int stands for a float


@pytest.mark.parametrize("name, values, error, words", [
    ("kv_ring", dict(window="64"), TypeError, r"window is of type int, got '64' \(str\)"),
    ("kv_ring", dict(sinks=True), TypeError, r"sinks is of type int, got True \(bool\)"),
    ("smoothquant", dict(search=1), TypeError, r"search is of type bool, got 1 \(int\)"),
    ("smoothquant", dict(alpha="0.5"), TypeError, r"alpha is of type float, got '0.5' \(str\)"),
    ("kv_ring", dict(sinkz=4), UserError, "no parameter 'sinkz'"),
    ("kv_rings", dict(), UserError, "unknown pass 'kv_rings'"),
    ("smoothquant", dict(alpha=1.5), UserError, r"outside \[0, 1\]"),  # the params' own checks still run
])
def test_typed_steps_refuse_unknown_fields_and_other_types(name, values, error, words):
    with pytest.raises(error, match=words):
        typed_step(name, **values)


def test_presets_and_build_pipeline():
    assert set(PRESETS) == {"w8a8-naive", "w8a8-sq", "w4a16-rtn", "w4a16-awq", "w4a16-gptq", "w4a16-gptq-asym"}
    gptq = preset_steps("w4a16-gptq-asym", block_size=64)
    assert [(s.name, s.params.block_size, s.params.symmetric, s.params.act_order) for s in gptq] == \
        [("gptq", 64, False, True)]
    awq = preset_steps("w4a16-awq", block_size=64)
    assert [s.name for s in awq] == ["awq", "awq_clip", "quantize_w4a16"]
    assert {s.params.block_size for s in awq} == {64}
    assert [s.name for s in build_pipeline("w8a8-sq")] == ["smoothquant", "quantize_w8a8", "lower_ort"]
    assert build_pipeline("w8a8-sq")[0].params.search                  # alpha searched per site
    fixed = build_pipeline("w8a8-sq", alpha=0.7)[0].params
    assert fixed.alpha == 0.7 and not fixed.search
    assert [s.name for s in build_pipeline("w4a16-rtn", backend="trt")] == ["quantize_w4a16"]
    steps = build_pipeline("w4a16-rtn", quantize_embeddings=True, accuracy_level=1)
    assert [s.name for s in steps] == ["quantize_w4a16", "quantize_embedding", "lower_ort"]
    assert steps[-1].params.accuracy_level == 1
    assert build_pipeline(None) == []
    with pytest.raises(UserError, match="unknown quantization preset"):
        preset_steps("w3a16")
    with pytest.raises(UserError, match="unknown backend"):
        build_pipeline("w8a8-sq", backend="tvm")


def test_registry_declares_exactness_and_calibration():
    table = passes()
    assert table["smoothquant"].is_exact(table["smoothquant"].params())
    assert table["awq"].is_exact(table["awq"].params()) and table["awq"].needs_calibration(table["awq"].params())
    assert not table["quantize_w8a8"].is_exact(table["quantize_w8a8"].params())
    lower = table["lower_ort"]
    assert lower.is_exact(lower.params(accuracy_level=0))
    assert not lower.is_exact(lower.params(accuracy_level=4))
    assert not lower.needs_calibration(lower.params())
    sparsify = table["sparsify"]                          # only Wanda reads activation statistics
    assert sparsify.needs_calibration(sparsify.params(method="wanda"))
    assert not sparsify.needs_calibration(sparsify.params(method="magnitude"))
    steps = parse_pipeline("sparsify:method=magnitude,awq,sparsify:method=wanda")
    assert [s.spec() for s in calibrated_steps(steps)] == ["awq", "sparsify"]
    assert all(info.doc for info in table.values())


def test_a_new_preset_is_one_row_of_the_spec(monkeypatch, tmp_path):
    """Adding a --quant preset touches core/quant_spec.py alone (and this test): with one row added, the
    CLI offers it, `build` runs its passes and build.json records them."""
    import json

    from enginesmith import cli
    from enginesmith.core import quant_spec

    monkeypatch.setitem(quant_spec.PRESETS, "w8a8-sq-half", "smoothquant:alpha=0.6,quantize_w8a8")
    assert [s.spec() for s in preset_steps("w8a8-sq-half")] == ["smoothquant:alpha=0.6", "quantize_w8a8"]
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} and the {i}" for i in range(1200)))
    out = tmp_path / "engine"
    assert cli.main(["build", "--model", "tiny:llama", "--quant", "w8a8-sq-half", "--calib-text", str(text),
                     "--calib-samples", "2", "--out", str(out)]) == 0
    passes = json.loads((out / "build.json").read_text())["passes"]
    assert "smoothquant:alpha=0.6" in passes and "quantize_w8a8" in passes, passes
