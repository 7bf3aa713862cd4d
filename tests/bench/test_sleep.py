"""`preload bench sleep`: a short real run on the CPU through the command line: every
wake answers the greedy output of before the first sleep, both levels timed, and the
cycles leave no process or fd behind; levels it does not know are refused."""

from __future__ import annotations

import json

from preload.bench.driver import preload


def test_a_short_run_on_the_cpu_wakes_to_the_same_answers_and_leaks_nothing(tmp_path):
    out = tmp_path / "sleep.json"
    r = preload("bench", "sleep", "--device", "cpu", "--cycles", "6", "--json", out, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert [run["level"] for run in result["runs"]] == [1] * 6 + [2] * 6
    for run in result["runs"]:
        assert run["same_output"] and run["error"] is None and run["spares_kept"] == 0, run  # (a CPU keeps none)
        assert 0 < run["sleep_s"] and 0 < run["wake_ready_s"] and 0 < run["wake_serving_s"] < 60, run
        assert run["after"]["processes"] == result["before"]["processes"]  # (daemon, zygote, front, core, spare...)
    for level in ("1", "2"):
        s = result["levels_summary"][level]
        assert s["same_output"] == 6 and s["growth"]["processes"] == 0 and s["growth"]["fds"] <= 1, s  # (one a cycle: +2)
    assert result["levels_summary"]["2"]["freed_share_min"] is None  # (no device: nothing to free on it)
    assert "wake to serving" in r.stdout and "6/6" in r.stdout


def test_levels_other_than_1_and_2_are_refused():
    r = preload("bench", "sleep", "--levels", "1,3", timeout=60)
    assert r.returncode == 2 and "--levels" in r.stderr


def test_what_holds_the_device_while_asleep_is_split_between_the_kept_spares_and_the_rest():
    """nvidia-smi's processes while asleep: the kept spares' MiB apart from the others' (the
    daemon's context); a process whose figure nvidia-smi does not give counts nothing."""
    from preload.bench.sleep import asleep_split

    apps = {4100: 526, 4200: 1721, 4300: None}
    assert asleep_split(apps, {4200, 4300}) == {"spares": 1721, "others": 526}
    assert asleep_split(apps, set()) == {"spares": 0, "others": 2247}
