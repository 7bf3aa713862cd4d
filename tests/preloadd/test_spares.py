"""Warm spares (`--spare-workers`) through the real command line: a spare forks,
attaches and warms up like any worker, then waits without a KV cache and without
accepting; when a worker dies it takes the slot at once and a new spare warms up; a
restart replaces the spares too (they run the code of before); a spare does not outlive
its daemon."""

from __future__ import annotations

import os
import signal
import time

from daemons import free_port, preload, running_daemon, wait_for
from supervised import REPLACE_TIMEOUT, complete, dead, kill, start_args, wait_replaced

# ---- warm spares ---------------------------------------------------------------------------
# A spare forks, attaches and warms up like any worker, then waits without a KV cache and
# without accepting. When a worker dies the spare takes its slot at once and a new spare
# warms up; a restart replaces the spares too (they run the code of before).


def standby_spare(d) -> dict | None:
    spares = d.status()["spares"]
    return spares[0] if len(spares) == 1 and spares[0]["state"] == "standby" else None


def test_a_spare_takes_a_dead_workers_slot_and_a_new_spare_warms_up(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--spare-workers", 1)) as d:
        [w] = d.status()["workers"]
        assert w["kv_cache_bytes"] == 512 << 20, "auto KV cache on CPU: 512 MiB"
        spare = wait_for(lambda: standby_spare(d), timeout=REPLACE_TIMEOUT)
        assert spare and spare["pid"] != w["pid"], d.status()
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]

        killed_at = time.time()
        kill(w["pid"])
        [w2] = wait_replaced(d, {0: w["pid"]})
        assert w2["pid"] == spare["pid"], "the warm spare took the slot instead of a fresh fork"
        assert w2["restarts"] == 1 and w2["last_exit"] == "killed by SIGKILL", w2
        # /status says when each stage happened: reaped, the spare given the slot, ready.
        rep = w2["last_replacement"]
        assert (rep["cause"], rep["via"], rep["old_pid"], rep["new_pid"]) == (
            "exit: killed by SIGKILL", "spare", w["pid"], spare["pid"]), rep
        assert killed_at <= rep["reaped"] <= rep["slot_given"] <= rep["ready"] <= time.time(), rep
        assert rep["forked"] < killed_at and rep["killed"] is None, "forked ahead; killed by us, not the daemon"
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy
        log = (d.state_dir / "worker-0.log").read_text()
        assert f"serving slot 0 (pid {spare['pid']})" in log, log[-2000:]

        spare2 = wait_for(lambda: standby_spare(d), timeout=REPLACE_TIMEOUT)
        assert spare2 and spare2["pid"] not in (w["pid"], spare["pid"]), d.status()

        # A rolling restart replaces the worker and the spare (they run the code of before).
        r = preload("restart", "--state-dir", d.state_dir)
        assert r.returncode == 0, r.stderr
        [w3] = wait_replaced(d, {0: w2["pid"]})
        assert w3["pid"] != spare2["pid"], "a restart must not promote a spare forked before it"
        spare3 = wait_for(lambda: (s := standby_spare(d)) and s["pid"] != spare2["pid"] and s, timeout=REPLACE_TIMEOUT)
        assert spare3, d.status()
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy


def test_a_spare_does_not_outlive_the_daemon(tiny_checkpoint, tmp_path):
    """Serving workers may outlive a crashed daemon (they hold their own mappings), but a
    spare has nothing to serve without one: it reads EOF on its go pipe and exits."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--spare-workers", 1)) as d:
        spare = wait_for(lambda: standby_spare(d), timeout=REPLACE_TIMEOUT)
        assert spare, d.status()
        [worker] = d.status()["workers"]
        os.kill(d.pid, signal.SIGKILL)

        try:
            assert wait_for(lambda: dead(spare["pid"]), timeout=30), "the spare is still running after its daemon died"
            assert not dead(worker["pid"]), "the serving worker outlives its daemon"
            complete(port, max_tokens=4)
        finally:  # nobody supervises the orphaned worker now: it is ours to stop
            kill(worker["pid"])
            assert wait_for(lambda: dead(worker["pid"]), timeout=10)
