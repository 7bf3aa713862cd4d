"""New connections go to the least loaded front (worker/load_board.py): a front declines
an accept while a live peer has fewer connections, for DEFER seconds at most (then it
takes the connection: a peer that does not accept cannot strand a client); a dead or
draining peer's cell does not count; and through a real daemon with two workers, long
requests arriving one after another are spread over both fronts, where the kernel's
accept order alone piled them up (this test with the gate off, DEFER = 0, on the CPU
machine: 4/2 three times out of three). Fronts in another time namespace (forked from a zygote
CRIU restored: their monotonic clock lags the host's) count as any other."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from daemons import free_port, running_daemon, total
from supervised import api, start_args

from preload.worker.load_board import DEFER, STALE, GatedSocket, LoadBoard


def listening() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def connect(sock: socket.socket) -> socket.socket:
    return socket.create_connection(sock.getsockname()[:2])


def test_a_front_leaves_a_connection_to_a_less_loaded_peer_then_takes_it(tmp_path):
    sock, peer = listening(), LoadBoard(tmp_path, 1)
    gated = GatedSocket(sock, LoadBoard(tmp_path, 0), lambda: 5)
    peer.publish(1)
    client = connect(sock)
    time.sleep(0.05)  # (in the backlog)
    t0 = time.monotonic()
    declined = 0
    while True:
        try:
            conn, _ = gated.accept()
            break
        except BlockingIOError:
            declined += 1
    waited = time.monotonic() - t0
    assert declined > 0 and DEFER * 0.9 <= waited < DEFER + 0.05, (declined, waited)
    conn.close()
    client.close()


def test_the_least_loaded_front_or_one_without_live_peers_accepts_at_once(tmp_path):
    sock = listening()
    mine = {"load": 2}
    gated = GatedSocket(sock, LoadBoard(tmp_path, 0), lambda: mine["load"])
    peer = LoadBoard(tmp_path, 1)
    for case in ("peer busier", "peer stale", "peer drained"):
        if case == "peer busier":
            peer.publish(3)
        elif case == "peer stale":
            peer.publish(0, now=time.time() - STALE - 1)  # (a front that died long ago)
        else:
            peer = LoadBoard(tmp_path, 1)
            peer.publish(0)
            peer.close()  # (draining: its cell is stale at once)
        client = connect(sock)
        time.sleep(0.05)
        conn, _ = gated.accept()  # (no BlockingIOError)
        conn.close()
        client.close()
        time.sleep(3 * DEFER)  # (the next case starts an episode of its own)


def test_the_board_counts_only_live_peers_and_a_fronts_own_accepts_at_once(tmp_path):
    a, b, c = LoadBoard(tmp_path, 0), LoadBoard(tmp_path, 7), LoadBoard(tmp_path, 1023)
    assert a.least_other() is None
    b.publish(4)
    c.publish(2, now=time.time() - STALE - 0.1)
    assert a.least_other() == 4 and b.least_other() is None
    c.publish(2, now=time.time() + 3600)  # (written before the clock was set back)
    assert a.least_other() == 4
    c.publish(2)
    assert a.least_other() == 2 and c.least_other() == 4
    sock = listening()
    gated = GatedSocket(sock, a, lambda: 0)
    clients = [connect(sock) for _ in range(3)]
    time.sleep(0.05)
    for _ in range(3):  # (a burst: each accept counts before the server registers it)
        gated.accept()[0].close()
    assert b.least_other() == 2 and c.least_other() == 3  # (a's cell: its 3 accepts)
    gated.publish()
    assert c.least_other() == 0  # (published as it stands: load() says 0)
    for client in clients:
        client.close()
    # A server that has registered its accepts already: each counted once, not twice.
    registered = []
    gated = GatedSocket(sock, a, lambda: len(registered))
    clients = [connect(sock) for _ in range(2)]
    time.sleep(0.05)
    for _ in range(2):
        registered.append(gated.accept()[0])
    assert c.least_other() == 2
    for conn in registered + clients:
        conn.close()


def test_long_requests_arriving_one_by_one_are_spread_over_both_fronts(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2)) as d:
        answers = []

        def request() -> None:
            t0 = time.monotonic()
            r = httpx.post(api(port) + "/v1/completions", timeout=300, json={
                "prompt": "t5 t6", "max_tokens": 250, "temperature": 0, "ignore_eos": True})
            answers.append((r.status_code, time.monotonic() - t0))

        threads, spacing = [threading.Thread(target=request) for _ in range(6)], 0.05
        for t in threads:
            t.start()
            time.sleep(spacing)  # (each arrives while the ones before are in flight)
        for t in threads:
            t.join()
        # (all in flight at once: each lasted longer than the arrivals took; a request is ~0.6 s on the
        # CI machine, so the arrivals come closer than that)
        assert [code for code, _ in answers] == [200] * 6 and min(s for _, s in answers) > 6 * spacing + 0.05, answers
        m = d.metrics()
        served = [total(m, "preload_http_requests_total", worker=str(w), route="/v1/completions", status="200")
                  for w in (0, 1)]
        # Spread, not dealt out evenly: a front defers an accept at most DEFER (20 ms) for a less
        # loaded peer, and a peer's loop busy longer than that on a loaded 2-core machine lets it
        # through (4 and 2 seen in CI). The kernel's accept order alone sent 4 of 4 to one front.
        assert sum(served) == 6 and min(served) >= 2, served


def test_a_front_whose_monotonic_clock_lags_the_hosts_counts_as_live(tmp_path):
    # CRIU restores a snapshot's zygote into a time namespace whose CLOCK_MONOTONIC goes on
    # from the dump's: its fronts' cells must read as live to fronts of a launched zygote.
    lagging = ["unshare", "--time", "--monotonic", str(-int(time.monotonic() // 2)), "--fork", sys.executable, "-c"]
    try:
        subprocess.run([*lagging, "pass"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no time namespace here (unshare --time): {e}")
    write = f"from preload.worker.load_board import LoadBoard; LoadBoard({str(tmp_path)!r}, 1).publish(3)"
    subprocess.run([*lagging, write], check=True)
    assert LoadBoard(tmp_path, 0).least_other() == 3
