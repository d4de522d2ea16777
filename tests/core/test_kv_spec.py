"""core/kv_spec.py: the one list of KV layouts, and a graph's layout read from its own metadata."""

from __future__ import annotations

import json

import pytest

from enginesmith.core import kv_spec


def test_every_place_that_names_kv_layouts_reads_the_spec():
    from enginesmith.builder import config
    from enginesmith.cli import flags
    from enginesmith.core import manifest
    from enginesmith.models import families

    assert config.KV_LAYOUTS == kv_spec.BUILD_CHOICES and config.KV_DTYPES == kv_spec.KV_DTYPES
    assert manifest.KV_TYPES == families.KV_LAYOUTS == kv_spec.LAYOUTS
    parser = flags.argparse.ArgumentParser()
    flags.add_kv_flags(parser)
    assert [a.choices for a in parser._actions if "--kv" in a.option_strings] == [kv_spec.BUILD_CHOICES]


@pytest.mark.parametrize("choice, stored", [("dense", ("dense", None)), ("ring", ("ring", None)),
                                            ("paged", ("paged", None)), ("h2o", ("ring", "h2o"))])
def test_a_build_choice_is_stored_as_a_layout_and_a_policy(choice, stored):
    assert kv_spec.stored_layout(choice) == stored
    assert stored[0] in kv_spec.LAYOUTS


def test_a_graph_without_metadata_is_dense_and_its_recorded_layout_is_read():
    assert kv_spec.graph_layout({}) == {"type": "dense"}
    ring = {"type": "ring", "sinks": 4, "window": 60, "capacity": 64}
    assert kv_spec.graph_layout({kv_spec.GRAPH_KEY: json.dumps(ring)}) == ring
    h2o = {**ring, "sinks": 0, "policy": "h2o"}
    assert kv_spec.graph_layout({kv_spec.GRAPH_KEY: json.dumps(h2o)})["policy"] == "h2o"


@pytest.mark.parametrize("value, match", [("x" * 5000, "characters"), ("{not json", "not JSON"),
                                          ('["ring"]', "names no KV layout"), ('{"type": "tree"}', "names no KV layout"),
                                          ('{"type": "ring", "policy": "lru"}', "ring policy")])
def test_untrusted_graph_metadata_is_refused_with_its_reason(value, match):
    with pytest.raises(ValueError, match=match):
        kv_spec.graph_layout({kv_spec.GRAPH_KEY: value})
