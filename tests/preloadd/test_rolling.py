"""Rolling restarts (preloadd/rolling.py): the next slots' replacements warm while the
current one does, as many as the spares retired at the start left room for; without spares,
one slot after another. Either way every core is replaced and serves the same answers."""

from __future__ import annotations

import re

from daemons import free_port, preload, running_daemon, wait_for
from supervised import complete, logs, start_args, wait_replaced, workers_of


def forks_and_takeovers(log: str, old_pids: set[int]) -> list[tuple[str, int]]:
    """The daemon log's replacement forks and takeovers, in order: ("fork", slot) and
    ("takeover", slot), for the cores that replace `old_pids`."""
    events = []
    for line in log.splitlines():
        if m := re.search(r"worker (\d+) started \(pid \d+\)", line):
            events.append(("fork", int(m[1])))
        elif (m := re.search(r"worker (\d+): pid \d+ takes over from pid (\d+)", line)) and int(m[2]) in old_pids:
            events.append(("takeover", int(m[1])))
    return events


def restart_events(d, workers: int) -> list[tuple[str, int]]:
    old = {w["slot"]: w["pid"] for w in workers_of(d)}
    assert len(old) == workers
    mark = len((d.state_dir / "daemon.log").read_text())
    r = preload("restart", "--state-dir", d.state_dir, "--timeout", 120, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr + logs(d.state_dir)
    wait_replaced(d, old)
    return forks_and_takeovers((d.state_dir / "daemon.log").read_text()[mark:], set(old.values()))


def test_with_a_spare_the_next_slots_replacement_warms_beside_the_first(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--spare-workers", 1)) as d:
        assert wait_for(lambda: [s for s in d.status()["spares"] if s["state"] == "standby"], timeout=60)
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]
        events = restart_events(d, 2)
        assert events[:2] == [("fork", 0), ("fork", 1)], events  # (slot 1's fork before slot 0 took over)
        assert {e for e in events if e[0] == "takeover"} == {("takeover", 0), ("takeover", 1)}, events
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy


def test_without_spares_one_slot_after_another(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--spare-workers", 0)) as d:
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]
        events = restart_events(d, 2)
        assert events == [("fork", 0), ("takeover", 0), ("fork", 1), ("takeover", 1)], events
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy
