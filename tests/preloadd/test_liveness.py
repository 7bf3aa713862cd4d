"""Hung workers: the daemon hears from every worker it supervises (a beat every half
second on the worker's own link) and kills and replaces one that
- sends nothing for --worker-timeout seconds (stopped, frozen, deadlocked),
- has work but finishes no engine step for --engine-step-timeout seconds, or
- is not ready --worker-start-timeout seconds after it was started (a stuck attach).
/status says why, and when each stage of the replacement happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from daemons import free_port, running_daemon, wait_for
from supervised import api, complete, logs, start_args, wait_replaced, workers_of, zygotes

from preload.ipc.sockets import listen
from preload.options import DaemonOptions, ServeOptions
from preload.preloadd import zygote as zyg
from preload.preloadd.supervisor import Supervisor
from preload.preloadd.workers import Worker


def test_a_stopped_worker_is_replaced_within_10_s_while_the_other_serves(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2)) as d:
        before = {w["slot"]: w["pid"] for w in workers_of(d)}
        results: list[tuple[float, str]] = []  # (sent at, outcome) of requests on fresh connections
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    complete(port, max_tokens=4, timeout=30)
                    results.append((sent, "ok"))
                except (AssertionError, httpx.HTTPError) as e:
                    results.append((sent, f"{type(e).__name__}: {e}"))

        clients = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in clients:
            t.start()
        try:
            assert wait_for(lambda: len(results) >= 10, timeout=60), "the load never got going"
            stopped_at = time.monotonic()
            os.kill(before[0], signal.SIGSTOP)
            [w] = [w for w in wait_replaced(d, {0: before[0]}, timeout=30) if w["slot"] == 0]
            replaced_in = time.monotonic() - stopped_at
            stop.set()
            for t in clients:
                t.join(60)
        finally:
            stop.set()
            try:
                os.kill(before[0], signal.SIGCONT)
            except ProcessLookupError:
                pass

        assert replaced_in < 10, f"replaced {replaced_in:.1f} s after SIGSTOP\n{logs(d.state_dir)}"
        assert "no heartbeat" in w["last_exit"] and w["last_exit"].startswith("killed by SIGKILL"), w
        rep = w["last_replacement"]
        assert rep["old_pid"] == before[0] and rep["new_pid"] == w["pid"], rep
        assert rep["killed"] <= rep["reaped"] <= rep["slot_given"] <= rep["ready"], rep
        # No request failed: those the stopped core held (and those its front took meanwhile)
        # waited for its replacement, which took them up; the other worker served throughout.
        assert len(results) >= 10 and all(o == "ok" for _, o in results), [o for _, o in results if o != "ok"][:5]
        assert workers_of(d)[1]["pid"] == before[1] and workers_of(d)[1]["restarts"] == 0
        complete(port)


def test_a_worker_stuck_in_its_attach_is_killed_at_the_start_deadline(tiny_checkpoint, tmp_path):
    """The fd socket is swapped for one that accepts and never answers: a replacement's
    attach then hangs (it beats meanwhile, so only the start deadline can tell). (The
    deadline counts from a worker's start: the zygote's imports before the first worker,
    3.5 s on a busy 2-core machine, are not the worker's.)"""
    port = free_port()
    extra = ("--worker-start-timeout", 5)
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, *extra)) as d:
        [w] = workers_of(d)
        fds = d.state_dir / "fds.sock"
        os.rename(fds, d.state_dir / "fds.sock.real")
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.bind(str(fds))
        silent.listen(16)
        try:
            os.kill(w["pid"], signal.SIGKILL)

            def stuck():
                s = workers_of(d)[0]
                return s if "not ready within 5 s" in (s["last_exit"] or "") else None

            s = wait_for(stuck, timeout=60, interval=0.1)
            assert s, f"{workers_of(d)}\n{logs(d.state_dir)}"
            assert s["last_exit"].startswith("killed by SIGKILL (hung"), s
        finally:
            silent.close()
            fds.unlink()
            os.rename(d.state_dir / "fds.sock.real", fds)
        wait_replaced(d, {0: w["pid"]}, timeout=60)
        complete(port)


def test_a_start_waits_for_the_zygotes_imports_longer_than_a_short_worker_start_timeout(tmp_path, monkeypatch):
    """--worker-start-timeout counts from a worker's start: a zygote still importing (no
    worker forked yet, slow on a loaded host) fails the start only after IMPORTS_TIMEOUT."""
    monkeypatch.setattr(zyg, "IMPORTS_TIMEOUT", 2.0)
    sup = Supervisor(DaemonOptions(workers=1, zygote=False), ServeOptions(state_dir=tmp_path), 0, None)
    sup._snapshot = {"workers": [{"slot": 0, "pid": None, "restarts": 0, "state": "starting",
                                  "front": {"restarts": 0, "state": "starting"}}], "spares": []}
    began = time.monotonic()
    why = sup.wait_started(0.5)
    assert time.monotonic() - began >= 2.0, why
    assert why == "workers not started within 2 s"


def fake_worker(tmp_path) -> tuple[Worker, socket.socket, subprocess.Popen]:
    """A real process that holds slot 0 and says what the test makes it say."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    daemon_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker = Worker(proc.pid, daemon_end, os.pidfd_open(proc.pid), slot=0, proc=proc, told=True, state="ready")
    return worker, worker_end, proc


def beat(link: socket.socket, steps: int, busy: bool) -> None:
    link.send(json.dumps({"event": "beat", "steps": steps, "busy": busy}).encode())


def supervise(tmp_path, worker: Worker) -> Supervisor:
    opts = DaemonOptions(workers=1, zygote=False, engine_step_timeout=1.0, worker_timeout=30.0)
    sup = Supervisor(opts, ServeOptions(state_dir=tmp_path), 0, listen("127.0.0.1", 0))
    sup.adopt(worker)
    sup.start()
    return sup


def test_a_worker_whose_engine_has_work_and_makes_no_step_is_killed(tmp_path):
    worker, link, proc = fake_worker(tmp_path)
    sup = supervise(tmp_path, worker)
    try:
        first = time.monotonic()
        while proc.poll() is None and time.monotonic() - first < 10:  # alive, busy, always at step 7
            try:
                beat(link, steps=7, busy=True)
            except BrokenPipeError:  # the daemon let go of its end: it is killing us
                break
            time.sleep(0.25)
        assert proc.wait(10) == -signal.SIGKILL
        assert time.monotonic() - first >= 1.0, "killed before --engine-step-timeout had passed"
        s = wait_for(lambda: (w := sup.status()["workers"][0])["last_exit"] and w, timeout=10)
        assert "made no step" in s["last_exit"], s
    finally:
        sup.stop(5)
        proc.kill()


def test_a_busy_engine_that_makes_steps_and_an_idle_one_are_left_alone(tmp_path):
    worker, link, proc = fake_worker(tmp_path)
    sup = supervise(tmp_path, worker)
    try:
        for i in range(8):  # busy and stepping, then idle and not stepping: 2 s each
            beat(link, steps=i, busy=True)
            time.sleep(0.25)
        for _ in range(8):
            beat(link, steps=8, busy=False)
            time.sleep(0.25)
        assert proc.poll() is None, sup.status()
        assert sup.status()["workers"][0]["pid"] == proc.pid
    finally:
        sup.stop(5)
        proc.kill()


def test_the_zygote_is_reaped_by_its_own_pid_with_its_own_exit_status(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        [z] = zygotes(d)
        os.kill(z.pid, signal.SIGKILL)
        line = f"zygote (pid {z.pid}) exited with status -9"
        assert wait_for(lambda: line in (d.state_dir / "daemon.log").read_text(), timeout=30), logs(d.state_dir)
        assert httpx.get(api(port) + "/health", timeout=10).status_code == 200


def test_a_stalled_daemon_holds_its_own_stall_against_no_worker(tiny_checkpoint, tmp_path):
    """Issue 36: the daemon SIGSTOPped for longer than --worker-timeout while clients run;
    the workers serve on meanwhile (they need no daemon to), and when it resumes it kills
    none of them as hung: its own stall is not their silence. No request fails."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--worker-timeout", "2")) as d:
        before = {w["slot"]: w["pid"] for w in workers_of(d)}
        results: list[str] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    complete(port, max_tokens=4, timeout=30)
                    results.append("ok")
                except (AssertionError, httpx.HTTPError) as e:
                    results.append(f"{type(e).__name__}: {e}")

        clients = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in clients:
            t.start()
        try:
            assert wait_for(lambda: len(results) >= 5, timeout=60), "the load never got going"
            os.kill(d.pid, signal.SIGSTOP)
            time.sleep(6)  # three times --worker-timeout
            served_while_stopped = len(results)
            os.kill(d.pid, signal.SIGCONT)
            time.sleep(4)  # two worker timeouts of a watching daemon
        finally:
            os.kill(d.pid, signal.SIGCONT)
            stop.set()
            for t in clients:
                t.join(60)
        after = {w["slot"]: w["pid"] for w in workers_of(d)}
        assert after == before, f"workers replaced after the daemon's stall\n{logs(d.state_dir)}"
        assert all(w["restarts"] == 0 for w in workers_of(d))
        assert served_while_stopped > 5 and all(r == "ok" for r in results), [r for r in results if r != "ok"][:5]
        assert "was stalled for" in (d.state_dir / "daemon.log").read_text()
