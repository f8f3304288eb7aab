"""scripts/bench_commits.py's check that both trees ran the same buckets over HTTP (each plans from its own
warm artifact's timings, so a ratio may compare plans rather than code)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from bench_commits import _since, only, plans_differ


def test_a_workload_run_on_other_buckets_is_named():
    report = {"short, HTTP": {"dispatched": {"before": {"16x128": 24}, "after": {"16x128": 24}}},
              "long, HTTP": {"dispatched": {"before": {"4x256": 96}, "after": {"16x256": 24}}},
              "long, in-process": {"median": 1.0}}
    lines = plans_differ(report)
    assert len(lines) == 1 and lines[0].startswith("long, HTTP:")
    assert "before 4x256 x96" in lines[0] and "after 16x256 x24" in lines[0]


def test_the_same_buckets_in_other_counts_are_one_plan():
    report = {"long, HTTP": {"dispatched": {"before": {"4x256": 96, "1x256": 2}, "after": {"1x256": 3, "4x256": 95}}}}
    assert plans_differ(report) == []


def test_batches_are_counted_from_the_scrape_before_the_rounds():
    assert _since({"4x256": 100, "16x256": 3}, {"4x256": 4, "16x256": 3}) == {"4x256": 96}
    assert _since({"4x256": 5}, {}) == {"4x256": 5}


def test_only_cuts_the_table_to_one_bucket(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"layout": "packed", "buckets": [{"batch": 4, "seqlen": 256, "slots": 8},
                                                                 {"batch": 16, "seqlen": 256, "slots": 8}]}))
    cut = json.loads(Path(only(str(table), "16x256", tmp_path)).read_text())
    assert cut == {"layout": "packed", "buckets": [{"batch": 16, "seqlen": 256, "slots": 8}]}
    with pytest.raises(SystemExit, match="no bucket 2x256"):
        only(str(table), "2x256", tmp_path)
