"""Supervision of engine workers: fork them from the zygote, replace the dead, roll restarts.

The daemon owns the API listening socket and every worker inherits it, so a client
that connects while a worker restarts waits in the kernel's backlog instead of being
refused. The daemon is a child subreaper: workers (double-forked by the zygote) are
its children, and it reaps them with waitpid.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("preload.daemon")

PR_SET_CHILD_SUBREAPER = 36
STABLE_AFTER = 5.0  # a worker that lived this long was not crash-looping
MAX_BACKOFF = 30.0
CODE_FOLDERS = ("preloadd", "worker", "kernels", "ipc", "cli")


def become_subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def code_version() -> str:
    """Changes when the installed preload code changes: the zygote must then be renewed."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for part in CODE_FOLDERS for p in (root / part).glob("*.py")):
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


@dataclass
class Worker:
    slot: int
    pid: int
    started: float = field(default_factory=time.monotonic)
    state: str = "starting"  # starting -> ready -> draining; or exited
    retiring: bool = False  # replaced on purpose: its exit is not a failure


@dataclass
class Slot:
    restarts: int = 0
    failures: int = 0  # consecutive early exits
    last_exit: str | None = None
    next_start: float = 0.0  # backoff: not before this time


class Zygote:
    """A running zygote process and the channel to it."""

    def __init__(self, spec: dict, listen_fd: int):
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "preload.preloadd.zygote", json.dumps(spec), str(listen_fd), str(theirs.fileno())]
        self.proc = subprocess.Popen(cmd, pass_fds=(listen_fd, theirs.fileno()))
        theirs.close()
        self.sock = ours
        self.stream = ours.makefile("rw", buffering=1)
        self.version = code_version()
        ready = self.stream.readline()
        if not ready:
            self.proc.wait()
            raise RuntimeError(f"the zygote exited with status {self.proc.returncode} before it was ready")

    def fork(self, slot: int) -> int:
        self.stream.write(json.dumps({"slot": slot}) + "\n")
        reply = self.stream.readline()
        if not reply:
            raise RuntimeError("the zygote died")
        return json.loads(reply)["pid"]

    def close(self) -> None:
        self.stream.close()
        self.sock.close()  # the zygote's loop ends when our end closes
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Supervisor:
    def __init__(self, count: int, spec: dict, listen: socket.socket, use_zygote: bool = True):
        self.count, self.spec, self.listen, self.use_zygote = count, spec, listen, use_zygote
        self.workers: dict[int, Worker] = {}  # by pid
        self.slots = [Slot() for _ in range(count)]
        self.zygote: Zygote | None = None
        self.zygote_restarts = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._renewing = threading.Event()
        self._ready = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    # ---- starting workers ---------------------------------------------------------------

    def start(self) -> None:
        become_subreaper()
        if self.use_zygote:
            self.zygote = Zygote(self.spec, self.listen.fileno())
        for slot in range(self.count):
            self._spawn(slot)
        self._thread.start()

    def _spawn(self, slot: int) -> Worker:
        with self._lock:
            if self.zygote is not None:
                pid = self.zygote.fork(slot)
            else:
                pid = self._spawn_fresh(slot)
            worker = self.workers[pid] = Worker(slot, pid)
            log.info("worker %d started (pid %d)", slot, pid)
            return worker

    def _spawn_fresh(self, slot: int) -> int:
        """Without a zygote: a new interpreter that imports everything itself."""
        fd = self.listen.fileno()
        spec = json.dumps(self.spec | {"slot": slot})
        log_path = f"{self.spec['state_dir']}/worker-{slot}.log"
        code = (
            "import sys; from preload.preloadd.zygote import run_worker; import json; "
            "sys.exit(run_worker(json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))"
        )
        return subprocess.Popen([sys.executable, "-c", code, spec, str(fd), log_path], pass_fds=(fd,), start_new_session=True).pid

    def mark_ready(self, pid: int) -> bool:
        with self._lock:
            worker = self.workers.get(pid)
            if worker is None:
                return False
            worker.state = "ready"
            self.slots[worker.slot].failures = 0  # the slot is out of any crash loop
            self._ready.notify_all()
            log.info("worker %d ready (pid %d) %.3f s after start", worker.slot, pid, time.monotonic() - worker.started)
            return True

    def wait_ready(self, pids: list[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not all(self.workers.get(p) and self.workers[p].state == "ready" for p in pids):
                if any(p not in self.workers for p in pids) or not self._ready.wait(deadline - time.monotonic()):
                    return False
                if time.monotonic() > deadline:
                    return False
            return True

    def all_ready(self, timeout: float) -> bool:
        return self.wait_ready([w.pid for w in self.workers.values()], timeout)

    # ---- watching -----------------------------------------------------------------------

    def _watch(self) -> None:
        version_checked = time.monotonic()
        while not self._stop.is_set():
            self._reap()
            self._refill()
            z = self.zygote
            if z is not None and not self._renewing.is_set():
                if z.proc.poll() is not None:
                    log.warning("zygote exited with status %s; starting a new one", z.proc.returncode)
                    self._renew_zygote()
                elif time.monotonic() - version_checked > 2.0:
                    version_checked = time.monotonic()
                    if code_version() != z.version:
                        log.info("installed code changed; renewing the zygote")
                        self._renew_zygote()
            self._stop.wait(0.01)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            with self._lock:
                worker = self.workers.pop(pid, None)
                if worker is None:
                    continue  # the zygote's own exit is seen through Popen.poll
                reason = describe_exit(status)
                slot = self.slots[worker.slot]
                slot.last_exit = reason
                self._ready.notify_all()
                if worker.retiring:
                    continue
                slot.restarts += 1
                early = time.monotonic() - worker.started < STABLE_AFTER and worker.state != "ready"
                slot.failures = slot.failures + 1 if early else 0
                delay = min(0.1 * 2 ** (slot.failures - 1), MAX_BACKOFF) if slot.failures > 1 else 0.0
                slot.next_start = time.monotonic() + delay
                log.warning("worker %d (pid %d) %s; %s", worker.slot, pid, reason,
                            f"restarting in {delay:.1f} s (crash loop)" if delay else "restarting now")

    def _refill(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            live = {w.slot for w in self.workers.values() if not w.retiring}
            for slot, info in enumerate(self.slots):
                if slot not in live and time.monotonic() >= info.next_start:
                    try:
                        self._spawn(slot)
                    except (OSError, RuntimeError) as e:
                        log.error("cannot start worker %d: %s", slot, e)
                        info.next_start = time.monotonic() + 1.0

    def _renew_zygote(self) -> None:
        """Start a new zygote in the background (imports take seconds; the watcher must
        keep reaping), and retire the old one once the new one is ready."""
        self._renewing.set()

        def renew() -> None:
            try:
                fresh = Zygote(self.spec, self.listen.fileno())
            except (OSError, RuntimeError) as e:
                log.error("cannot start a zygote: %s", e)
                return
            finally:
                self._renewing.clear()
            with self._lock:
                old, self.zygote = self.zygote, fresh
                self.zygote_restarts += 1
            old.close()
            log.info("zygote renewed (pid %d)", fresh.proc.pid)

        threading.Thread(target=renew, name="zygote-renew", daemon=True).start()

    # ---- restarts -----------------------------------------------------------------------

    def restart(self, now: bool, drain_timeout: float) -> None:
        """Replace every worker. now: kill them all, the watcher refills at once.
        Otherwise one at a time: the replacement is ready before the old one drains."""
        if now:
            with self._lock:
                for w in list(self.workers.values()):
                    w.retiring = True
                    self.slots[w.slot].restarts += 1
                    _signal(w.pid, signal.SIGKILL)
            return
        with self._lock:  # workers already on their way out (an earlier restart) are not replaced twice
            current = sorted((w for w in self.workers.values() if not w.retiring), key=lambda w: w.slot)
        for old in current:
            fresh = self._spawn(old.slot)
            with self._lock:
                old.retiring = True  # the watcher must not refill this slot meanwhile
                self.slots[old.slot].restarts += 1
            if not self.wait_ready([fresh.pid], timeout=120):
                log.error("replacement for worker %d did not become ready; keeping the old one", old.slot)
                old.retiring = False
                continue
            old.state = "draining"
            _signal(old.pid, signal.SIGTERM)
            deadline = time.monotonic() + drain_timeout + 5
            while old.pid in self.workers and time.monotonic() < deadline:
                time.sleep(0.01)
            if old.pid in self.workers:
                _signal(old.pid, signal.SIGKILL)

    def status(self) -> list[dict]:
        with self._lock:
            now = time.monotonic()
            by_slot = {w.slot: w for w in self.workers.values() if not w.retiring}
            return [
                {
                    "slot": slot,
                    "pid": by_slot[slot].pid if slot in by_slot else None,
                    "state": by_slot[slot].state if slot in by_slot else ("backoff" if info.failures > 1 else "restarting"),
                    "uptime_s": round(now - by_slot[slot].started, 3) if slot in by_slot else 0.0,
                    "restarts": info.restarts,
                    "last_exit": info.last_exit,
                    "consecutive_failures": info.failures,
                }
                for slot, info in enumerate(self.slots)
            ]

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            pids = list(self.workers)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if not _reaped(p)]
            time.sleep(0.02)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
            _reaped(pid, block=True)
        if self.zygote is not None:
            self.zygote.close()


def describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reaped(pid: int, block: bool = False) -> bool:
    try:
        done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return True
