"""A worker of several processes (`--tensor-parallel-size 2`, issue 38), through the real
command line: the daemon serves the bundled model (float32) with exactly the greedy
output of a one-process worker, tensor- and expert-parallel; the group lives and dies as
one: a follower killed ends its core, a core killed takes its followers with it, and
either way the slot serves again from a whole new group, its requests answered; a stop
leaves no process of the group.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from daemons import daemon_processes, free_port, running_daemon, wait_for
from supervised import complete, dead, greedy, start_args

@pytest.fixture(scope="module")
def one_process(tiny_checkpoint, tmp_path_factory):
    port = free_port()
    with running_daemon(tmp_path_factory.mktemp("one") / "state", tiny_checkpoint, *start_args(port)):
        return greedy(port)


def followers(core: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(core).children() if "preload.worker.tensor_group" in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("experts", [(), ("--enable-expert-parallel",)], ids=["tensor-parallel", "expert-parallel"])
def test_a_group_of_two_serves_what_one_process_serves(tiny_checkpoint, tmp_path, one_process, experts):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--tensor-parallel-size", 2,
                                                                         *experts)) as d:
        [w] = d.status()["workers"]
        assert len(followers(w["pid"])) == 1
        assert greedy(port) == one_process


def test_the_group_lives_and_dies_as_one(tiny_checkpoint, tmp_path, one_process):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--tensor-parallel-size", 2)) as d:
        for victim in ("follower", "core"):
            [w] = d.status()["workers"]
            [f] = followers(w["pid"])
            os.kill(f.pid if victim == "follower" else w["pid"], signal.SIGKILL)
            assert wait_for(lambda: dead(w["pid"]) and dead(f.pid), timeout=30), f"the {victim}'s death left the group"
            new = wait_for(lambda: next((x for x in d.status()["workers"] if x["state"] == "ready"
                                         and x["pid"] != w["pid"]), None), timeout=120)
            assert new and len(followers(new["pid"])) == 1
            assert greedy(port) == one_process
            assert complete(port)["choices"][0]["text"]
        state_dir = d.state_dir
        group = [d.status()["workers"][0]["pid"], *(f.pid for f in followers(d.status()["workers"][0]["pid"]))]
    assert all(dead(p) for p in group) and daemon_processes(state_dir) == []
    assert not list(state_dir.glob("group-*.rendezvous"))
