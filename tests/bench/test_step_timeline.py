"""A step's timeline (bench/step_timeline.py) splits its wall time into the host's time to
the first device activity, the activities' union, the idle gaps between them and the time
after the last, and names the largest gaps by the activities on either side; what began
outside the call is not its. Profiling itself needs a GPU: tests/gpu/test_bench.py."""

from __future__ import annotations

import pytest

from preload.bench.step_timeline import describe, timeline


def test_the_parts_add_up_and_overlapping_work_counts_once():
    device = [(110.0, 200.0, "a"), (150.0, 260.0, "b"),  # overlapping: busy 110-260
              (300.0, 400.0, "c"),  # a 40 us gap after b
              (410.0, 420.0, "d"), (415.0, 418.0, "e"),  # e inside d; a 10 us gap after c
              (50.0, 90.0, "before the call"), (1200.0, 1300.0, "after the call")]
    t = timeline((100.0, 1000.0), device)
    assert t["wall_ms"] == pytest.approx(0.9)
    assert t["to_first_ms"] == pytest.approx(0.010)
    assert t["busy_ms"] == pytest.approx((150 + 100 + 10) / 1e3)
    assert t["idle_ms"] == pytest.approx(0.050)
    assert t["after_last_ms"] == pytest.approx(0.580)
    assert t["to_first_ms"] + t["busy_ms"] + t["idle_ms"] + t["after_last_ms"] == pytest.approx(t["wall_ms"])
    assert t["activities"] == 5
    assert [(g["us"], g["after"], g["before"]) for g in t["gaps"]] == [(40.0, "b", "c"), (10.0, "c", "d")]
    assert t["gaps"][0]["at_ms"] == pytest.approx(0.160)


def test_only_the_largest_gaps_are_kept():
    device = [(i * 100.0, i * 100.0 + 100 - i, f"k{i}") for i in range(1, 10)]  # gap i after kernel i
    t = timeline((0.0, 2000.0), device, gaps=3)
    assert [g["us"] for g in t["gaps"]] == [8.0, 7.0, 6.0]
    assert "gap" in describe(t) and describe(t).count("\n") == 3


def test_a_call_with_no_device_work_says_so():
    t = timeline((0.0, 500.0), [(600.0, 700.0, "later")])
    assert t["activities"] == 0 and t["to_first_ms"] is None
    assert "no device activity" in describe(t)
