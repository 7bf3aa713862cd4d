"""Data parallelism (`--data-parallel-size`, issue 38) through the real command line, on
the CPU, where each rank's copy of the weights is a memfd of its own as each GPU's is an
allocation of its own: one daemon loads a copy per rank (the same fingerprint), places
`--workers` and `--spare-workers` per rank, and each core maps its own rank's copy and
no other; the one API port serves the greedy output of a one-rank daemon; a rank's dead
core is replaced by that rank's spare; a killed daemon's successor takes every copy and
every worker back; one started with another size lets the copies go and retires the
workers of the slots it no longer has; a stop leaves nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from daemons import ARENA_LABEL, PRELOAD, arena_inodes, daemon_processes, free_port, running_daemon, wait_for
from supervised import dead, greedy, kill_daemon, ready_workers, start_args


def mapped_arenas(pid: int) -> set[int]:
    """The inodes of the weight arenas process `pid` maps."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {int(f[4]) for f in (line.split(maxsplit=5) for line in maps.splitlines())
            if len(f) == 6 and f[5].startswith("/" + ARENA_LABEL)}


def dp_args(port: int, size: int = 2, *extra) -> tuple:
    return start_args(port, 1, "--data-parallel-size", size, *extra)


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint, tmp_path_factory):
    port = free_port()
    with running_daemon(tmp_path_factory.mktemp("one") / "state", tiny_checkpoint, *start_args(port)):
        return greedy(port)


def test_each_rank_has_a_copy_of_its_own_and_its_slots_and_spares_map_only_that(tiny_checkpoint, tmp_path,
                                                                                  one_rank):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *dp_args(port, 2, "--spare-workers", 1)) as d:
        s = d.status()
        assert [(c["dp_rank"], c["device"]) for c in s["data_parallel"]] == [(0, "cpu"), (1, "cpu")]
        assert s["data_parallel"][0]["bytes"] == s["data_parallel"][1]["bytes"] > 0
        assert s["bytes_per_device"] == {"cpu": 2 * s["data_parallel"][0]["bytes"]}
        copies = {ino for _, ino in arena_inodes(s["pid"])}
        assert len(copies) == 2  # (the daemon holds both; nothing else was loaded)

        workers = wait_for(lambda: (w := ready_workers(d)) and len(w) == 2 and w, timeout=60)
        assert [(w["slot"], w["dp_rank"]) for w in workers] == [(0, 0), (1, 1)]
        spares = wait_for(lambda: (sp := d.status()["spares"]) and len(sp) == 2
                          and all(x["state"] == "standby" for x in sp) and sp, timeout=60)
        by_rank = {x["dp_rank"]: x["pid"] for x in spares}
        assert sorted(by_rank) == [0, 1]
        core_copy = [mapped_arenas(w["pid"]) for w in workers]
        assert all(len(c) == 1 for c in core_copy) and core_copy[0] != core_copy[1] and set().union(*core_copy) == copies
        assert [mapped_arenas(by_rank[k]) for k in (0, 1)] == core_copy  # (a spare warms on its rank's copy)

        shown = subprocess.run([PRELOAD, "status", "--state-dir", str(d.state_dir)], capture_output=True, text=True,
                               timeout=30).stdout
        assert "in 2 copies (data-parallel ranks)" in shown and "worker 1 (rank 1): ready" in shown, shown
        for _ in range(3):  # (the port's connections land on either rank's front)
            assert greedy(port) == one_rank
        # Each front's series name its rank as vLLM names a DP engine's (`engine`); here slot k is rank k.
        series = [line for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines()
                  if line.startswith("preload_prompt_tokens_total{")]
        labels = [dict(re.findall(r'(\w+)="([^"]*)"', line)) for line in series]
        assert labels and all(x["engine"] == x["worker"] for x in labels), series
        assert sum(float(line.rsplit(" ", 1)[1]) for line in series) > 0

        os.kill(workers[1]["pid"], signal.SIGKILL)
        new = wait_for(lambda: (w := ready_workers(d)) and w[1]["pid"] != workers[1]["pid"] and w, timeout=60)
        assert new[1]["pid"] == by_rank[1] and new[1]["dp_rank"] == 1  # rank 1's spare, not rank 0's
        assert mapped_arenas(new[1]["pid"]) == core_copy[1]
        assert greedy(port) == one_rank
        state_dir = d.state_dir
    assert daemon_processes(state_dir) == []


def test_a_new_daemon_takes_back_every_copy_and_worker_and_one_of_another_size_lets_them_go(tiny_checkpoint, tmp_path,
                                                                                             one_rank):
    port, state_dir = free_port(), tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, *dp_args(port)) as first:
        ready = wait_for(lambda: (w := ready_workers(first)) and len(w) == 2 and w, timeout=60)
        workers = [w["pid"] for w in ready]
        copies = arena_inodes(first.status()["pid"])
        kill_daemon(first)
        assert greedy(port) == one_rank  # (the orphans serve on)
        with running_daemon(state_dir, tiny_checkpoint, *dp_args(port)) as second:
            s = second.status()
            assert s["readopted"] and arena_inodes(s["pid"]) == copies  # (no load: the kept copies)
            ws = wait_for(lambda: (w := ready_workers(second)) and len(w) == 2 and w, timeout=60)
            assert [w["pid"] for w in ws] == workers and [w["dp_rank"] for w in ws] == [0, 1]  # adopted, in place
            assert greedy(port) == one_rank
            kill_daemon(second)
        with running_daemon(state_dir, tiny_checkpoint, *start_args(port)) as third:  # one rank now
            s = third.status()
            assert not s["readopted"] and len(s["data_parallel"]) == 1
            assert not arena_inodes(s["pid"]) & copies  # the kept copies let go, one loaded
            assert wait_for(lambda: dead(workers[1]), timeout=60)  # slot 1 is gone: its worker retired
            assert greedy(port) == one_rank
    assert daemon_processes(state_dir) == [] and all(dead(p) for p in workers)


def test_an_orphan_core_is_taken_back_only_into_a_slot_of_the_rank_whose_copy_it_maps():
    """A daemon restarted with other --workers places ranks differently: the core of old
    slot 1 (rank 1 with one worker a rank) maps rank 1's copy, and slot 1 is rank 0's now;
    its front, which labels its series with rank 1, goes too."""
    from preload.preloadd.orphans import Adoption

    adoption = Adoption(None, "fp", ["127.0.0.1", 8000], {})
    two_a_rank = lambda slot: slot // 2  # noqa: E731 (--workers 2)
    core = {"pid": 1, "fingerprint": "fp", "listen": ["127.0.0.1", 8000], "dp_rank": 1}
    assert "slot 1 is rank 0's" in adoption.verdict(core | {"slot": 1}, 4, lambda s: True, two_a_rank)
    assert adoption.verdict(core | {"slot": 3}, 4, lambda s: True, two_a_rank) is None
    # A front maps no weights, but its /metrics name its rank (`engine`): it too goes only where that holds.
    front = {"pid": 2, "fingerprint": "fp", "listen": ["127.0.0.1", 8000], "role": "front", "dp_rank": 1}
    assert "slot 1 is rank 0's" in adoption.verdict(front | {"slot": 1}, 4, lambda s: True, two_a_rank)
    assert adoption.verdict(front | {"slot": 2}, 4, lambda s: True, two_a_rank) is None


def test_a_tensor_parallel_group_maps_its_slots_copy_in_every_process(tiny_checkpoint, tmp_path, one_rank):
    """--data-parallel-size 2 with --tensor-parallel-size 2: rank 1's slot is a group of two
    processes, and its follower maps rank 1's copy, as its core does."""
    import psutil

    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *dp_args(port, 2, "--tensor-parallel-size", 2)) as d:
        workers = wait_for(lambda: (w := ready_workers(d)) and len(w) == 2 and w, timeout=120)
        for w in workers:
            [follower] = [p for p in psutil.Process(w["pid"]).children()
                          if "preload.worker.tensor_group" in " ".join(p.cmdline())]
            assert mapped_arenas(follower.pid) == mapped_arenas(w["pid"]) and len(mapped_arenas(w["pid"])) == 1
        assert mapped_arenas(workers[0]["pid"]) != mapped_arenas(workers[1]["pid"])
        assert greedy(port) == one_rank


def test_a_core_left_mapping_copies_the_new_daemon_loaded_again_retires_rather_than_keep_them_alive(tiny_checkpoint,
                                                                                                    tmp_path, one_rank):
    """Another --data-parallel-size: the kept copies are let go and one loaded anew. Slot 0's
    core (rank 0 in both) maps a copy the daemon let go; taken on, its mapping would keep that
    copy in memory beside the new one. It retires, and a core on the new copy serves."""
    port, state_dir = free_port(), tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, *dp_args(port)) as first:
        old = wait_for(lambda: (w := ready_workers(first)) and len(w) == 2 and w, timeout=60)
        kill_daemon(first)
        with running_daemon(state_dir, tiny_checkpoint, *start_args(port)) as second:
            s = second.status()
            loaded = {ino for _, ino in arena_inodes(s["pid"])}
            assert not s["readopted"] and len(loaded) == 1
            assert wait_for(lambda: dead(old[0]["pid"]), timeout=60)
            [w] = wait_for(lambda: (w := ready_workers(second)) and w[0]["pid"] != old[0]["pid"] and w, timeout=60)
            assert mapped_arenas(w["pid"]) == loaded
            assert "retires: it maps the weights the last daemon held; this one loaded them again" in \
                (state_dir / "daemon.log").read_text()
            assert greedy(port) == one_rank
    assert daemon_processes(state_dir) == []
