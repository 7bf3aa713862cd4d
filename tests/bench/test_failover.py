"""`preload bench failover`: its figures read as the bench's docstring says (which requests
count as met by no kill, the pause a stream saw across a kill), and a short real run on
the CPU, with and without MTP drafts: every request answered, each the uninterrupted output,
each kill's takeover timed."""

from __future__ import annotations

import json

import pytest

from preload.bench.driver import preload
from preload.bench.failover import Outcome, figures


def outcome(prompt: int, text: str, sent: float, done: float, chunks=()) -> Outcome:
    o = Outcome(stream=bool(chunks), prompt=prompt, ok=True, text=text, chunks=list(chunks), sent=sent)
    o.done = done
    return o


def test_requests_no_kill_met_are_those_done_before_the_first_or_sent_after_the_last():
    want = ["a", "b"]
    outcomes = [outcome(0, "a", 0.0, 0.9),  # before the first kill (at 1.0)
                outcome(1, "x", 0.1, 0.95),  # before it too, but unlike the uninterrupted output
                outcome(0, "y", 0.5, 1.5),  # met the first kill
                outcome(1, "b", 2.5, 3.5),  # sent after the last kill (at 2.0)
                outcome(0, "a", 1.2, 1.8)]  # between two kills: met neither, yet not counted as calm
    f = figures(outcomes, want, killed_at=[1.0, 2.0])
    assert (f["requests"], f["failed"], f["outputs_differ"]) == (5, 0, 2)
    assert (f["met_no_kill"], f["differ_met_no_kill"]) == (3, 1)


def test_the_pause_is_the_longest_gap_spanning_a_kill_less_the_median_gap():
    stream = outcome(0, "a", 0.0, 2.0, chunks=[0.1, 0.2, 0.3, 1.3, 1.4, 1.5])  # gaps 0.1 but one of 1.0 over the kill
    f = figures([stream], ["a"], killed_at=[0.5])
    assert abs(f["added_latency_s"]["p50"] - 0.9) < 1e-9 and f["kills_seen_by_a_stream"] == 1


@pytest.mark.parametrize("drafts", [0, 2], ids=["plain", "mtp drafts"])
def test_a_short_run_on_the_cpu_loses_nothing(tmp_path, drafts):
    """With MTP drafts the kills land mid-drafting too: the replacement resumes from the
    tokens emitted, never from drafts not yet verified."""
    r = preload("bench", "failover", "--device", "cpu", "--clients", "2", "--kills", "2", "--max-tokens", "8",
                "--speculative-tokens", str(drafts), "--json", tmp_path / "fo.json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    [run] = json.loads((tmp_path / "fo.json").read_text())["runs"]
    assert (run["failed"], run["outputs_differ"], run["differ_met_no_kill"]) == (0, 0, 0)
    assert run["met_no_kill"] >= 4  # two answers from each client before the first kill
    assert run["takeover_s"]["n"] == 2 and 0 < run["takeover_s"]["p50"] < 60
    assert (run["draft_tokens"] > 0) == (drafts > 0) and 0 <= run["accepted_tokens"] <= run["draft_tokens"]
    assert "takeover p50" in r.stdout
