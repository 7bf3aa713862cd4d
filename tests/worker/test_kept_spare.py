"""A spare kept through a level-1 sleep, its half (worker/link.py, worker/serve.py): told,
it lets go of the daemon's weights and says "released"; at the wake it maps the new
arena the daemon sends ("remap" + its fd) and says "remapped"; then it takes its slot as
any spare does. One that cannot be kept says why ("kept_failed") and waits on. The GPU
half (the driver's checkpoint, the addresses kept) is tests/gpu/test_sleep_level1.py."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from preload.worker.link import DaemonLink
from preload.worker.serve import map_weights_again


def hear(daemon: socket.socket) -> dict:
    daemon.settimeout(10)
    return json.loads(daemon.recv(1 << 16))


def spare_waiting(let_go, map_again) -> tuple[socket.socket, list]:
    """The daemon's end of a spare's link, the spare blocked in wait_for_slot on a thread;
    what it returns lands in the list."""
    daemon, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link, got = DaemonLink(theirs.detach()), []
    threading.Thread(target=lambda: got.append((link.wait_for_slot(let_go, map_again), link.takeover)),
                     daemon=True).start()
    return daemon, got


def test_a_kept_spare_lets_go_maps_again_then_takes_its_slot():
    calls = []
    daemon, got = spare_waiting(lambda: calls.append("let go"), lambda msg, fds: calls.append((msg, fds)))
    daemon.send(json.dumps({"release": True}).encode())
    assert hear(daemon) == {"event": "released"} and calls == ["let go"]

    read_end, write_end = os.pipe()
    remap = {"remap": True, "arena": {"transport": "cuda-vmm", "size": 1 << 21, "device": 0}, "fingerprint": "f00d"}
    socket.send_fds(daemon, [json.dumps(remap).encode()], [read_end])
    assert hear(daemon) == {"event": "remapped"}
    msg, fds = calls[1]
    assert msg == remap and len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(read_end).st_ino  # (the same pipe)

    daemon.send(json.dumps({"slot": 3, "takeover": "restart"}).encode())
    for _ in range(500):
        if got:
            break
        threading.Event().wait(0.01)
    assert got == [(3, "restart")]
    for fd in (read_end, write_end, fds[0]):
        os.close(fd)
    daemon.close()


def test_a_spare_that_cannot_be_kept_says_why_and_waits_on():
    def let_go():
        raise RuntimeError("only a worker mapping one daemon's weights alone can be kept through a sleep")

    daemon, got = spare_waiting(let_go, lambda msg, fds: None)
    daemon.send(json.dumps({"release": True}).encode())
    said = hear(daemon)
    assert said["event"] == "kept_failed" and "RuntimeError: only a worker mapping" in said["why"]
    daemon.send(json.dumps({"slot": 0}).encode())
    for _ in range(500):
        if got:
            break
        threading.Event().wait(0.01)
    assert got == [(0, "first")]
    daemon.close()


def test_weights_offered_that_are_not_ours_are_refused_and_their_fd_closed():
    """map_weights_again: the fd is the spare's only once mapped; a refusal closes it."""

    class Refusing:
        def map_weights_again(self, info, fds, fingerprint):
            assert info.size == 1 << 21 and info.device == 0 and fingerprint == "other"
            raise ValueError("the daemon offers weights other, not these")

    read_end, write_end = os.pipe()
    msg = {"remap": True, "arena": {"transport": "cuda-vmm", "size": 1 << 21, "device": 0}, "fingerprint": "other"}
    with pytest.raises(ValueError, match="not these"):
        map_weights_again(Refusing(), msg, [read_end])
    with pytest.raises(OSError):
        os.fstat(read_end)
    os.close(write_end)
