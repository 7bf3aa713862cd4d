"""A slot's KV memory outlives its workers: the first worker of a slot makes it and
sends its fd to the daemon, which holds it; every later worker of the slot (a spare
taking over, a fresh fork, a rolling restart, an orphan adopted by a new daemon) maps
that same memory instead of allocating its own, so a restart neither frees nor clears
a KV cache. The daemon holds one per slot, never more; answers stay what they were."""

from __future__ import annotations

from daemons import KV_LABEL, arena_inodes, free_port, preload, running_daemon, wait_for
from supervised import REPLACE_TIMEOUT, complete, kill, kill_daemon, logs, ready_workers, start_args, wait_replaced


def kv_of(pid: int) -> set[tuple[int, int]]:
    return arena_inodes(pid, KV_LABEL)


def test_every_later_worker_of_a_slot_maps_the_kv_memory_the_first_made(tiny_checkpoint, tmp_path):
    port = free_port()
    args = start_args(port, 2, "--spare-workers", 1)
    with running_daemon(tmp_path / "state", tiny_checkpoint, *args) as d:
        ws = wait_for(lambda: ready_workers(d), timeout=REPLACE_TIMEOUT)
        kv = {w["slot"]: kv_of(w["pid"]) for w in ws}
        assert all(len(k) == 1 for k in kv.values()) and kv[0] != kv[1], kv  # one each, their own
        assert kv_of(d.pid) == kv[0] | kv[1], "the daemon holds each slot's memory"
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]

        # A spare takes slot 0; then slot 0 again, by a spare or a fork (whichever is ready).
        for _ in range(2):
            [old] = [w for w in d.status()["workers"] if w["slot"] == 0]
            kill(old["pid"])
            [new] = [w for w in wait_replaced(d, {0: old["pid"]}) if w["slot"] == 0]
            assert kv_of(new["pid"]) == kv[0], "the new worker allocated instead of mapping the slot's memory"
            assert kv_of(d.pid) == kv[0] | kv[1], "the daemon holds one per slot, no more"
            for _ in range(4):  # both workers answer as before (the stale cache is never read)
                assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy
        log = (d.state_dir / "worker-0.log").read_text()
        assert log.count("the slot's, mapped again") == 2, log[-3000:]

        # A rolling restart: each new worker maps its slot's memory once the old one is gone.
        old = {w["slot"]: w["pid"] for w in d.status()["workers"]}
        assert preload("restart", "--state-dir", d.state_dir, "--timeout", REPLACE_TIMEOUT).returncode == 0
        ws = wait_replaced(d, old)
        assert {w["slot"]: kv_of(w["pid"]) for w in ws} == kv, logs(d.state_dir)
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy


def test_an_orphan_hands_its_kv_memory_to_the_daemon_that_adopts_it(tiny_checkpoint, tmp_path):
    port, state_dir = free_port(), tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, *start_args(port)) as first:
        [w] = wait_for(lambda: ready_workers(first), timeout=REPLACE_TIMEOUT)
        kv = kv_of(w["pid"])
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]
        kill_daemon(first)
        with running_daemon(state_dir, tiny_checkpoint, *start_args(port)) as second:
            [adopted] = wait_for(lambda: ready_workers(second), timeout=REPLACE_TIMEOUT)
            assert adopted["pid"] == w["pid"], logs(state_dir)
            assert wait_for(lambda: kv_of(second.pid) == kv, timeout=10), "the new daemon holds the orphan's KV memory"
            kill(w["pid"])
            [new] = wait_replaced(second, {0: w["pid"]})
            assert kv_of(new["pid"]) == kv and kv_of(second.pid) == kv
            assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy
