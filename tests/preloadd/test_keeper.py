"""Nothing is lost when the daemon dies: a keeper process holds the weights' arena and
the API socket, the workers serve on, and a new `preload start` on the same state dir
takes all of it back: the same arena (one copy, never re-read: the checkpoint is made
unreadable first), the same port (never closed: no request fails), the same workers
(supervised again). A start with other settings lets the kept weights go and retires the
orphans instead. A clean stop leaves nothing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from daemons import arena_inodes, daemon_processes, free_port, running_daemon, sockets_in, wait_for
from supervised import PROMPT, api, dead, kill_daemon, logs, ready_workers, start_args


class Load:
    """Clients sending completions to the API port without a pause, counting failures."""

    def __init__(self, port: int, clients: int = 4):
        self.port, self.ok, self.failed = port, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(base_url=api(self.port), timeout=60) as client:
            while not self._stop.is_set():
                try:
                    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def __exit__(self, *exc) -> None:
        self.stop()


def arenas_of(state_dir) -> set:
    """The weight arenas every live process of `state_dir` holds: one means one copy."""
    return set().union(*(arena_inodes(p.pid) for p in daemon_processes(state_dir)))


def test_a_new_daemon_takes_back_the_weights_the_port_and_the_workers(tiny_checkpoint, tmp_path):
    """Two workers, four clients sending all along, the daemon SIGKILLed, a new one started."""
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    port, state_dir = free_port(), tmp_path / "state"
    args = start_args(port, 2)
    with running_daemon(state_dir, model, *args) as first:
        s = first.status()
        workers = sorted(w["pid"] for w in s["workers"])
        keeper, fingerprint, arena = s["keeper_pid"], s["fingerprint"], arenas_of(state_dir)
        assert keeper and not s["readopted"] and len(workers) == 2 and len(arena) == 1
        with Load(port) as load:
            wait_for(lambda: load.ok >= 5, timeout=30)
            kill_daemon(first)
            served = load.ok
            assert wait_for(lambda: load.ok >= served + 10, timeout=30), "the orphaned workers stopped serving"
            for f in model.glob("*.safetensors"):  # a load now would fail: what follows reads none of it
                f.chmod(0)
            try:
                with running_daemon(state_dir, model, *args) as second:
                    s = second.status()
                    assert s["readopted"] and s["fingerprint"] == fingerprint
                    assert s["keeper_pid"] == keeper  # the same keeper holds on, for the next crash
                    assert s["load_seconds"] < 1.0
                    # Nothing on the way to ready imported torch (seconds on a GPU host): ready in well under one.
                    assert "libtorch" not in Path(f"/proc/{s['pid']}/maps").read_text()
                    ws = wait_for(lambda: (w := ready_workers(second)) and len(w) == 2 and w, timeout=30)
                    assert sorted(w["pid"] for w in ws) == workers, f"{ws}\n{logs(state_dir)}"  # adopted, not replaced
                    assert arenas_of(state_dir) == arena  # one copy of the weights throughout, in every process
                    served = load.ok
                    assert wait_for(lambda: load.ok >= served + 10, timeout=30)
                    assert "supervised again" in (state_dir / "daemon.log").read_text()
                    load.stop()  # (before the stop closes the port)
            finally:
                for f in model.glob("*.safetensors"):
                    f.chmod(stat.S_IRUSR | stat.S_IWUSR)
        assert load.failed == [], load.failed[:5]  # the port never closed, no request was dropped
    assert daemon_processes(state_dir) == [], [p.info for p in daemon_processes(state_dir)]
    assert sockets_in(state_dir) == []
    assert dead(keeper) and all(dead(pid) for pid in workers)


def test_a_dead_keeper_is_replaced_so_that_the_daemons_death_still_loses_nothing(tiny_checkpoint, tmp_path):
    """Issue 36: the keeper SIGKILLed, then the daemon: its death went unnoticed and the
    next start could not listen on the port. Now a new keeper takes the weights and the
    socket at once, and the next start takes all of it back, the workers too, with no
    request failed."""
    port, state_dir = free_port(), tmp_path / "state"
    args = start_args(port, 1)
    with running_daemon(state_dir, tiny_checkpoint, *args) as first:
        s = first.status()
        old_keeper, workers = s["keeper_pid"], sorted(w["pid"] for w in s["workers"])
        with Load(port) as load:
            wait_for(lambda: load.ok >= 5, timeout=30)
            os.kill(old_keeper, 9)
            keeper = wait_for(lambda: (k := first.status()["keeper_pid"]) not in (None, old_keeper) and k, timeout=30)
            assert keeper and not dead(keeper), f"no new keeper\n{logs(state_dir)}"
            assert "the keeper (pid %d) died" % old_keeper in (state_dir / "daemon.log").read_text()
            kill_daemon(first)
            with running_daemon(state_dir, tiny_checkpoint, *args) as second:
                s = second.status()
                assert s["readopted"] and s["keeper_pid"] == keeper
                ws = wait_for(lambda: (w := ready_workers(second)) and len(w) == 1 and w, timeout=30)
                assert sorted(w["pid"] for w in ws) == workers, f"{ws}\n{logs(state_dir)}"
                served = load.ok
                assert wait_for(lambda: load.ok >= served + 5, timeout=30)
                load.stop()
        assert load.failed == [], load.failed[:5]
    assert daemon_processes(state_dir) == [] and dead(old_keeper) and dead(keeper)


def test_a_daemon_with_other_settings_lets_the_kept_weights_go_and_retires_the_orphans(tiny_checkpoint, tmp_path):
    port, state_dir = free_port(), tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, *start_args(port)) as first:
        s = first.status()
        [worker], keeper = s["workers"], s["keeper_pid"]
        kill_daemon(first)
        with running_daemon(state_dir, tiny_checkpoint, *start_args(port), quant="fp8_block") as second:
            s = second.status()
            assert not s["readopted"] and s["keeper_pid"] not in (None, keeper)
            assert dead(keeper)  # released before the new load: never two copies held for nobody
            assert wait_for(lambda: dead(worker["pid"]), timeout=30), "the orphan serving other weights did not retire"
            ws = wait_for(lambda: ready_workers(second), timeout=60)
            assert ws and ws[0]["pid"] != worker["pid"]
            r = httpx.post(api(port) + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            assert "retires: it serves other weights" in (state_dir / "daemon.log").read_text()
    assert daemon_processes(state_dir) == []


def test_a_daemon_on_another_port_retires_the_orphans_serving_the_old_one(tiny_checkpoint, tmp_path):
    """Clients now come to the new port: an orphan adopted on the old one would leave the
    new port with nobody behind it."""
    old_port, new_port, state_dir = free_port(), free_port(), tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, *start_args(old_port)) as first:
        [worker] = first.status()["workers"]
        kill_daemon(first)
        with running_daemon(state_dir, tiny_checkpoint, *start_args(new_port)) as second:
            assert wait_for(lambda: dead(worker["pid"]), timeout=30), "the orphan of the old port was adopted"
            ws = wait_for(lambda: ready_workers(second), timeout=60)
            assert ws and ws[0]["pid"] != worker["pid"]
            r = httpx.post(api(new_port) + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            assert f"retires: it serves ['127.0.0.1', {old_port}]" in (state_dir / "daemon.log").read_text()
    assert daemon_processes(state_dir) == []


def test_without_a_keeper_the_weights_go_with_the_daemon(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, "--no-keeper") as d:
        assert d.status()["keeper_pid"] is None
        assert [p.pid for p in daemon_processes(state_dir)] == [d.pid]
        assert sockets_in(state_dir) == ["control.sock", "fds.sock"]


def test_a_daemon_without_workers_retires_the_workers_a_dead_one_left(tiny_checkpoint, tmp_path):
    port, state_dir = free_port(), tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint, *start_args(port)) as first:
        [worker] = first.status()["workers"]
        kill_daemon(first)
        with running_daemon(state_dir, tiny_checkpoint) as second:  # holds the weights only
            assert second.status()["readopted"]
            assert wait_for(lambda: dead(worker["pid"]), timeout=30), "the orphan kept serving for nobody"
    assert daemon_processes(state_dir) == []


def test_the_daemon_imports_no_torch():
    """What a daemon needs up to ready when it takes its weights back from a keeper: torch
    (4-6 s to import on a GPU host) is imported only to load."""
    code = "import sys, preload.preloadd.daemon; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_keeper_spawned_before_the_load_leaves_nothing_if_the_daemon_ends_first(tmp_path):
    """A daemon spawns its keeper as its load begins (the keeper's interpreter starts beside
    the load, not after it) and gives it the weights once loaded. Stopped before that, or
    killed (its end of the socket closes), the daemon leaves no keeper: it exits 0, having
    bound no socket and held nothing."""
    from preload.preloadd.keeper import KEEPER_SOCK, KeeperLink

    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    stopped = KeeperLink.spawn(state_dir)
    stopped.release()  # a clean stop during the load
    assert dead(stopped.pid)
    killed = KeeperLink.spawn(state_dir)
    killed.sock.close()  # what the kernel does for a daemon SIGKILLed during its load
    _, status = os.waitpid(killed.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (state_dir / KEEPER_SOCK).exists()
    log = (state_dir / "keeper.log").read_text()
    assert log.count("the daemon stopped before it had weights to keep") == 2, log


def test_a_handover_carries_every_copys_fds_apart_and_reads_a_one_copy_keepers_form():
    """A handover (keeper.py's wire: a message, the fds on it) carries each data-parallel
    rank's manifest and arena fds as its own, the API socket last; the form a keeper of
    one copy sent before data parallelism is read as one copy; counts that do not add up
    are refused and every fd that came closed."""
    import socket

    from preload.ipc.protocol import send_with_fds
    from preload.preloadd.keeper import Kept, ProtocolError, _receive, _send

    def memfds(n):
        return [os.memfd_create(f"copy{i}") for i in range(n)]

    a, b = socket.socketpair()
    api = socket.socket()
    kept = Kept([{"rank": 0}, {"rank": 1}], [memfds(1), memfds(2)], api)
    _send(a, kept)
    got = _receive(b)
    assert got.manifests == [{"rank": 0}, {"rank": 1}] and [len(f) for f in got.arena_fds] == [1, 2]
    assert [[os.readlink(f"/proc/self/fd/{fd}") for fd in fds] for fds in got.arena_fds] == [
        ["/memfd:copy0 (deleted)"], ["/memfd:copy0 (deleted)", "/memfd:copy1 (deleted)"]]
    assert got.api is not None and got.api.family == socket.AF_INET
    got.close()
    kept.close()

    old = memfds(1)
    send_with_fds(a, {"manifest": {"rank": 0}, "arena_fds": 1, "api": False}, old)
    got = _receive(b)
    assert got.manifests == [{"rank": 0}] and len(got.arena_fds) == 1 and len(got.arena_fds[0]) == 1 and got.api is None
    got.close()

    before = len(os.listdir("/proc/self/fd"))
    send_with_fds(a, {"manifests": [{}, {}], "arena_fds": [1, 2], "api": False}, old * 2)  # (2 fds where 3 are said)
    with pytest.raises(ProtocolError, match="malformed handover"):
        _receive(b)
    assert len(os.listdir("/proc/self/fd")) == before
    for fd in old:
        os.close(fd)
    a.close()
    b.close()
