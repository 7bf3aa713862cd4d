"""Sleep and wake through the real command line (issue 37): `preload sleep` lets every
engine core and spare go (level 2: the weights too) while the fronts hold the clients;
the daemon's and the API's /health say so (503), the daemon's /is_sleeping says true, a
request sent meanwhile waits and is answered after `preload wake`, with the same greedy
output as before the sleep; the HTTP routes vLLM names are for the operator only; cycles
of sleep and wake leave nothing behind.

Every daemon is a real process tree (`preload start`), on the tiny checkpoint in float32.
"""

from __future__ import annotations

import os
import threading

import httpx
import psutil
from daemons import arena_holders, arena_inodes, free_port, preload, running_daemon, wait_for
from supervised import api, complete, dead, start_args

TOKENS = 16


def text(port: int) -> str:
    return complete(port, max_tokens=TOKENS)["choices"][0]["text"]


def cores(d) -> set[int]:
    s = d.status()
    return {w["pid"] for w in s["workers"] if w["pid"]} | {w["pid"] for w in s["spares"]}


def fronts(d) -> set[int]:
    return {w["front"]["pid"] for w in d.status()["workers"]}


def sleep(d, *args) -> str:
    r = preload("sleep", "--state-dir", d.state_dir, *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def wake(d) -> str:
    r = preload("wake", "--state-dir", d.state_dir, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_asleep_no_core_runs_requests_wait_and_the_wake_answers_them_as_before(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--spare-workers", 1)) as d:
        before = text(port)
        assert wait_for(lambda: len(cores(d)) == 2, timeout=60)  # (the worker and its spare)
        old_cores, old_fronts = cores(d), fronts(d)

        spare = d.status()["spares"][0]["pid"]
        said = sleep(d)
        assert "asleep (level 1)" in said and "GiB of weights held in host memory" in said, said
        assert all(dead(pid) for pid in old_cores), "a core or spare outlived the sleep"
        log = (d.state_dir / "daemon.log").read_text()
        assert f"spare (pid {spare}) killed by SIGKILL (sleep)" in log, log[-3000:]  # (not left to exit on EOF)
        assert cores(d) == set() and fronts(d) == old_fronts  # (the fronts hold the clients)
        health = d.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "sleeping"
        assert d.get("/is_sleeping").json() == {"is_sleeping": True}
        s = d.status()
        assert s["sleep"]["level"] == 1 and s["sleep"]["host_bytes"] == s["bytes_per_device"]["cpu"] > 0
        front = httpx.get(api(port) + "/health", timeout=10)
        assert front.status_code == 503 and "sleeping" in front.text

        waiting: list[str] = []
        t = threading.Thread(target=lambda: waiting.append(text(port)))
        t.start()
        t.join(1.0)
        assert t.is_alive(), "a request sent while asleep was answered without a core"
        assert "awake in" in wake(d)
        t.join(60)
        assert waiting == [before]
        assert text(port) == before
        assert d.get("/health").status_code == 200 and d.get("/is_sleeping").json() == {"is_sleeping": False}
        assert wait_for(lambda: len(cores(d)) == 2, timeout=60)  # (a spare again)
        assert not cores(d) & old_cores and [w["restarts"] for w in d.status()["workers"]] == [0]


def test_level_2_lets_the_weights_go_and_the_wake_reads_them_again(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        before, fingerprint = text(port), d.status()["fingerprint"]
        arena = arena_inodes(d.pid)
        assert arena
        said = sleep(d, "--level", 2)
        assert "asleep (level 2)" in said and "0.00 GiB" in said, said
        s = d.status()
        assert s["fingerprint"] is None and s["bytes_per_device"]["cpu"] == 0 and s["keeper_pid"] is None
        assert wait_for(lambda: not arena_holders(arena), timeout=10), arena_holders(arena)  # the memory is freed
        attach = preload("restart", "--state-dir", d.state_dir, timeout=60)
        assert attach.returncode == 1 and "sleeping" in attach.stderr
        wake(d)
        s = d.status()
        assert s["fingerprint"] == fingerprint and s["keeper_pid"] and s["state"] == "ready"
        assert text(port) == before


def test_sleep_and_wake_over_http_are_for_the_operator_only(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "open", tiny_checkpoint, *start_args(port)) as d:
        r = httpx.post(d.url + "/sleep?level=1", timeout=10)
        assert r.status_code == 403 and "preload sleep" in r.json()["error"]
        assert d.get("/is_sleeping").json() == {"is_sleeping": False}
    port = free_port()
    with running_daemon(tmp_path / "keyed", tiny_checkpoint, *start_args(port, 1, "--api-key", "k3y")) as d:
        assert httpx.post(d.url + "/sleep", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
        bad = httpx.post(d.url + "/sleep?level=3", headers={"Authorization": "Bearer k3y"}, timeout=10)
        assert bad.status_code == 400 and "level" in bad.json()["error"]
        r = httpx.post(d.url + "/sleep?level=1", headers={"Authorization": "Bearer k3y"}, timeout=120)
        assert r.status_code == 200, r.text
        assert d.get("/is_sleeping").json() == {"is_sleeping": True} and cores(d) == set()
        r = httpx.post(d.url + "/wake_up", headers={"Authorization": "Bearer k3y"}, timeout=300)
        assert r.status_code == 200, r.text
        assert d.get("/health").status_code == 200


CYCLES = 5


def test_cycles_of_sleep_and_wake_leave_nothing_behind(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--spare-workers", 1)) as d:
        before = text(port)
        daemon = psutil.Process(d.pid)
        for i in range(CYCLES):
            sleep(d, "--level", 1 + i % 2)
            wake(d)
            assert text(port) == before
            if i == 0:  # (after a first cycle: what a cycle may allocate once is allocated)
                assert wait_for(lambda: len(cores(d)) == 2, timeout=60)
                fds, children = daemon.num_fds(), len(daemon.children(recursive=True))
        assert wait_for(lambda: len(cores(d)) == 2, timeout=60)
        assert wait_for(lambda: daemon.num_fds() <= fds, timeout=10), (daemon.num_fds(), fds)  # (none gained a cycle)
        assert wait_for(lambda: len(daemon.children(recursive=True)) == children, timeout=30), daemon.children(True)
        assert os.listdir(d.state_dir / "metrics")  # (the workers' series are still served)


def test_a_wake_that_cannot_bring_the_weights_back_leaves_it_asleep_and_the_next_one_can(tiny_checkpoint, tmp_path):
    """A wake that fails (here level 2's files gone meanwhile; on a GPU, level 1's device
    memory taken by another process) leaves the daemon asleep and alive, says why, and a
    later `preload wake` brings the same weights back."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    port = free_port()
    with running_daemon(tmp_path / "state", model, *start_args(port)) as d:
        before = text(port)
        sleep(d, "--level", 2)
        model.rename(tmp_path / "moved")
        r = preload("wake", "--state-dir", d.state_dir, timeout=300)
        assert r.returncode == 1 and "still asleep: the wake failed" in r.stderr, r.stdout + r.stderr
        s = d.status()
        assert s["state"] == "sleeping" and s["sleep"]["asleep"] and s["sleep"]["failed_wakes"] == 1, s["sleep"]
        (tmp_path / "moved").rename(model)
        wake(d)
        s = d.status()
        assert s["state"] == "ready" and s["sleep"] is None
        assert text(port) == before
