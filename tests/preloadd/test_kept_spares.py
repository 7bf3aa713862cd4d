"""The supervisor's half of keeping spares through a level-1 sleep (preloadd/sleeping.py):
a sleep that keeps them tells each warm spare to let go of the weights and kills every
other core and spare; a kept spare is not a core left to wait for; what it answers
moves it from releasing to released, and, once told the new arena, to standby, where
the wake's refill finds it; one that cannot be kept is killed. Real processes stand in
for the workers (their links are real sockets); the device's part runs on a GPU only
(tests/gpu/test_sleep_level1.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from preload.ipc.manifest import ArenaInfo
from preload.preloadd.sleeping import cores_left, on_kept_event, remap_message, sleep_request
from preload.preloadd.workers import Slot, Worker


@pytest.fixture
def tree():
    """A supervisor's records of one slot's core and front, a warm spare and a warming one;
    the daemon's ends of their links are `w.link`, the workers' ends in `ends`."""
    procs, ends, workers = [], {}, {}
    for slot, role, state in ((0, "core", "ready"), (0, "front", "ready"), (None, "core", "standby"),
                              (None, "core", "warming")):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        w = Worker(proc.pid, ours, -1, slot, proc, role=role, state=state, told=slot is not None)
        procs.append(proc)
        workers[proc.pid], ends[proc.pid] = w, theirs
    sup = SimpleNamespace(workers=workers, slots=[Slot()], rolling=None, _restart_queued=False, asleep=None)
    yield sup, ends
    for proc in procs:
        proc.kill()
        proc.wait()
    for w in workers.values():
        w.link.close()
    for end in ends.values():
        end.close()


def by(sup, role: str, state: str) -> Worker:
    return next(w for w in sup.workers.values() if w.role == role and w.state == state)


def said(end: socket.socket) -> tuple[dict, list[int]]:
    end.settimeout(10)
    data, fds, _, _ = socket.recv_fds(end, 1 << 16, 2)
    return json.loads(data), fds


def test_a_sleep_that_keeps_spares_tells_the_warm_one_and_kills_the_rest(tree):
    sup, ends = tree
    core, front, spare, warming = (by(sup, "core", "ready"), by(sup, "front", "ready"), by(sup, "core", "standby"),
                                   by(sup, "core", "warming"))
    sleep_request(sup, "sleep", (1, True))
    assert sup.asleep == 1
    assert said(ends[spare.pid])[0] == {"release": True} and spare.state == "releasing" and not spare.retiring
    assert said(ends[front.pid])[0] == {"sleeping": True, "level": 1}
    for w in (core, warming):
        assert w.retiring and w.kill_reason == "sleep" and w.proc.wait(10) == -9
    assert spare.proc.poll() is None
    assert cores_left(sup) == 2  # (the killed ones, until reaped; not the kept spare)

    on_kept_event(sup, spare, "released", {})
    assert spare.state == "released" and cores_left(sup) == 2
    read_end, write_end = os.pipe()
    arena = remap_message(SimpleNamespace(arena=ArenaInfo("cuda-vmm", 2 << 20, 0), fingerprint="f"))
    assert arena == {"remap": True, "arena": {"transport": "cuda-vmm", "size": 2 << 20, "device": 0}, "fingerprint": "f"}
    sleep_request(sup, "kept", ("remap", {0: (arena, [read_end])}))
    msg, fds = said(ends[spare.pid])
    assert msg == arena and len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(read_end).st_ino
    on_kept_event(sup, spare, "remapped", {})
    assert spare.state == "standby" and spare.proc.poll() is None  # (a warm spare again)
    for fd in (read_end, write_end, *fds):
        os.close(fd)


def test_without_keeping_every_core_and_spare_goes(tree):
    sup, ends = tree
    sleep_request(sup, "sleep", (1, False))
    cores = [w for w in sup.workers.values() if w.role == "core"]
    assert all(w.retiring and w.proc.wait(10) == -9 for w in cores) and cores_left(sup) == 3


def test_a_spare_that_cannot_be_kept_is_killed(tree):
    sup, ends = tree
    spare = by(sup, "core", "standby")
    sleep_request(sup, "sleep", (1, True))
    on_kept_event(sup, spare, "kept_failed", {"why": "RuntimeError: it maps another daemon's draft model"})
    assert spare.retiring and spare.proc.wait(10) == -9
    assert spare.kill_reason == "not kept through the sleep: RuntimeError: it maps another daemon's draft model"


def test_the_daemon_lets_a_kept_spare_go_when_it_cannot_be_kept(tree):
    sup, ends = tree
    spare = by(sup, "core", "standby")
    sleep_request(sup, "sleep", (1, True))
    on_kept_event(sup, spare, "released", {})
    sleep_request(sup, "kept", ("let_go", (spare.pid, "not kept through the sleep: it did not map the weights again in time")))
    assert spare.retiring and spare.proc.wait(10) == -9 and cores_left(sup) == 3


def test_a_daemon_stopping_while_asleep_kills_a_kept_spare_at_once(tree):
    """Checkpointed by the driver, a kept spare could not even exit on its link's EOF (its
    close waits on CUDA): it is killed, the others are stopped as ever."""
    from preload.preloadd.supervisor import Supervisor

    sup, ends = tree
    spare, warming = by(sup, "core", "standby"), by(sup, "core", "warming")
    sleep_request(sup, "sleep", (1, True))
    on_kept_event(sup, spare, "released", {})
    retired = []
    sup.retire_spare = retired.append
    Supervisor._begin_stop(sup, 5.0)
    assert spare.kill_reason == "daemon stopping" and spare.proc.wait(10) == -9
    assert retired == [warming]  # (a spare not kept, waiting for a slot: its link's EOF ends it)


def test_a_kept_spare_takes_a_slot_only_once_it_maps_the_weights_again(tree):
    """Before, its views would read unmapped addresses: a slot to fill goes to a fork, and
    the kept spare, still a spare of the pool (none other is forked for it), takes a slot
    as any standby spare does once it has mapped them (the wake remaps before it fills)."""
    from preload.preloadd.supervisor import Supervisor

    sup, ends = tree
    spare = by(sup, "core", "standby")
    sleep_request(sup, "sleep", (1, True))
    on_kept_event(sup, spare, "released", {})
    forked, told = [], []
    sup.idle_spares = lambda dp_rank=None: Supervisor.idle_spares(sup, dp_rank)
    sup.dp_rank, sup._can_fork = (lambda slot: 0), (lambda: True)
    sup.spawn = lambda slot: forked.append(slot) or SimpleNamespace(slot=slot)
    sup.go = told.append
    Supervisor._fill(sup, 0)
    assert forked == [0] and spare.slot is None and spare.state == "released"
    assert sup.idle_spares(0) == [spare]  # (the pool's spare: the refill forks no other)

    on_kept_event(sup, spare, "remapped", {})
    Supervisor._fill(sup, 0)
    assert forked == [0] and spare.slot == 0 and told[-1] is spare
