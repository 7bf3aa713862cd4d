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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from preload.preloadd import zygote

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
    pid: int
    go: int | None  # write end of its go pipe, until it has been told its slot
    slot: int | None = None  # None: a spare
    started: float = field(default_factory=time.monotonic)  # forked, or promoted from spare
    state: str = "warming"  # spare: warming -> standby; in a slot: starting -> ready -> draining
    kv_cache_bytes: int = 0
    retiring: bool = False  # replaced on purpose: its exit is not a failure


@dataclass
class Slot:
    restarts: int = 0
    failures: int = 0  # consecutive early exits
    last_exit: str | None = None
    next_start: float = 0.0  # backoff: not before this time


class Zygote:
    """A zygote process and the channel to it. It is launched at once and spends
    seconds importing; `wait_ready` blocks until it can fork."""

    def __init__(self, spec: dict, listen_fd: int):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-m", "preload.preloadd.zygote", json.dumps(spec), str(listen_fd), str(theirs.fileno())]
        self.proc = subprocess.Popen(cmd, pass_fds=(listen_fd, theirs.fileno()))
        theirs.close()
        self.sock = ours
        self.version = code_version()
        self.ready = False

    def wait_ready(self) -> Zygote:
        if not self.ready:
            ready, _ = zygote.receive(self.sock)
            if not ready:
                self.proc.wait()
                raise RuntimeError(f"the zygote exited with status {self.proc.returncode} before it was ready")
            self.ready = True
        return self

    def fork(self, slot: int | None) -> tuple[int, int]:
        """A new worker's pid and the write end of its go pipe."""
        zygote.send(self.sock, {"slot": slot})
        reply, fds = zygote.receive(self.sock)
        if not reply or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError("the zygote died")
        return reply["pid"], fds[0]

    def close(self) -> None:
        self.sock.close()  # the zygote's loop ends when our end closes
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Supervisor:
    """Keeps `count` workers serving and `spares` warm spare workers waiting beside them.
    A spare has attached, warmed up and waits for a slot; when a worker dies the spare
    takes its slot (allocates its KV cache and accepts) at once, and a new spare warms up.
    `room_for(kv_bytes)` says whether the device has room for one more KV cache of that
    size, so that a rolling restart can run old and new side by side."""

    def __init__(self, count: int, spec: dict, listen: socket.socket, use_zygote: bool = True, spares: int = 0,
                 room_for: Callable[[int], bool] = lambda kv_bytes: True):
        self.count, self.spec, self.listen, self.use_zygote = count, spec, listen, use_zygote
        self.spares, self.room_for = spares, room_for
        self.workers: dict[int, Worker] = {}  # by pid
        self.slots = [Slot() for _ in range(count)]
        self.spare_pool = Slot()  # restarts and backoff of the spares
        self.zygote: Zygote | None = None
        self.zygote_restarts = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._renewing = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    # ---- starting workers ---------------------------------------------------------------

    def prepare(self) -> None:
        """Launch the zygote: its imports then overlap whatever the daemon does before
        `start` (loading the weights)."""
        become_subreaper()
        if self.use_zygote:
            self.zygote = Zygote(self.spec, self.listen.fileno())

    def start(self) -> None:
        if self.zygote is not None:
            self.zygote.wait_ready()
        for slot in range(self.count):
            self._go(self._spawn(slot))
        self._thread.start()

    def _spawn(self, slot: int | None) -> Worker:
        """Fork a worker for `slot` (it waits for its go all the same) or a spare."""
        with self._lock:
            if self.zygote is not None:
                pid, go = self.zygote.fork(slot)
            else:
                pid, go = self._spawn_fresh(slot)
            worker = self.workers[pid] = Worker(pid, go, slot)
            log.info("%s started (pid %d)", "spare" if slot is None else f"worker {slot}", pid)
            return worker

    def _spawn_fresh(self, slot: int | None) -> tuple[int, int]:
        """Without a zygote: a new interpreter that imports everything itself."""
        fd = self.listen.fileno()
        go_r, go_w = os.pipe()
        spec = json.dumps(self.spec | {"slot": slot})
        log_path = f"{self.spec['state_dir']}/{zygote.log_name(slot)}"
        code = (
            "import sys; from preload.preloadd.zygote import run_worker; import json; "
            "sys.exit(run_worker(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))"
        )
        try:
            proc = subprocess.Popen([sys.executable, "-c", code, spec, str(fd), str(go_r), log_path],
                                    pass_fds=(fd, go_r), start_new_session=True)
        except BaseException:
            os.close(go_w)
            raise
        finally:
            os.close(go_r)
        return proc.pid, go_w

    def _go(self, worker: Worker) -> None:
        """Tell a worker (forked for its slot, or a spare just given one) to serve its slot."""
        worker.state, worker.started = "starting", time.monotonic()
        go, worker.go = worker.go, None
        try:
            os.write(go, f"{worker.slot}\n".encode())
        except BrokenPipeError:
            pass  # it died meanwhile: the reaper deals with it
        finally:
            os.close(go)

    def _fill(self, slot: int) -> None:
        """Put a worker in a vacant slot: a spare if there is one (the warmest first), else a fresh fork."""
        with self._lock:
            spares = sorted(self._spares(), key=lambda w: (w.state != "standby", w.started))
            if spares:
                worker = spares[0]
                worker.slot = slot
                log.info("spare (pid %d, %s) takes slot %d", worker.pid, worker.state, slot)
            else:
                worker = self._spawn(slot)
            self._go(worker)

    def _spares(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.slot is None and not w.retiring]

    def mark_warm(self, pid: int) -> bool:
        with self._lock:
            worker = self.workers.get(pid)
            if worker is None:
                return False
            if worker.go is not None:  # still waiting for its go
                worker.state = "standby"
                if worker.slot is None:
                    self.spare_pool.failures = 0
                self._changed.notify_all()
            return True

    def mark_ready(self, pid: int, kv_cache_bytes: int = 0) -> bool:
        with self._lock:
            worker = self.workers.get(pid)
            if worker is None or worker.slot is None:
                return False
            worker.state, worker.kv_cache_bytes = "ready", kv_cache_bytes
            self.slots[worker.slot].failures = 0  # the slot is out of any crash loop
            self._changed.notify_all()
            log.info("worker %d ready (pid %d) %.3f s after start", worker.slot, pid, time.monotonic() - worker.started)
            return True

    def wait_state(self, pids: list[int], state: str, timeout: float) -> bool:
        """Wait until every worker in `pids` is in `state`; False on timeout or if one exits."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not all(self.workers.get(p) and self.workers[p].state == state for p in pids):
                if any(p not in self.workers for p in pids) or not self._changed.wait(deadline - time.monotonic()):
                    return False
                if time.monotonic() > deadline:
                    return False
            return True

    def all_ready(self, timeout: float) -> bool:
        return self.wait_state([w.pid for w in self.workers.values() if w.slot is not None], "ready", timeout)

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
                if worker.go is not None:
                    os.close(worker.go)
                reason = describe_exit(status)
                record = self.spare_pool if worker.slot is None else self.slots[worker.slot]
                record.last_exit = reason
                self._changed.notify_all()
                if worker.retiring:
                    continue
                record.restarts += 1
                early = time.monotonic() - worker.started < STABLE_AFTER and worker.state not in ("ready", "standby")
                record.failures = record.failures + 1 if early else 0
                delay = min(0.1 * 2 ** (record.failures - 1), MAX_BACKOFF) if record.failures > 1 else 0.0
                record.next_start = time.monotonic() + delay
                name = "spare" if worker.slot is None else f"worker {worker.slot}"
                log.warning("%s (pid %d) %s; %s", name, pid, reason,
                            f"restarting in {delay:.1f} s (crash loop)" if delay else "restarting now")

    def _refill(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            try:
                live = {w.slot for w in self.workers.values() if not w.retiring}
                for slot, info in enumerate(self.slots):
                    if slot not in live and time.monotonic() >= info.next_start:
                        self._fill(slot)
                # Spares warm up while no worker is starting, so that they never slow down one that is.
                starting = any(w.slot is not None and w.state != "ready" and not w.retiring for w in self.workers.values())
                if not starting and len(self._spares()) < self.spares and time.monotonic() >= self.spare_pool.next_start:
                    self._spawn(None)
            except (OSError, RuntimeError) as e:
                log.error("cannot start a worker: %s", e)
                for info in (*self.slots, self.spare_pool):
                    info.next_start = max(info.next_start, time.monotonic() + 1.0)

    def _renew_zygote(self) -> None:
        """Start a new zygote in the background (imports take seconds; the watcher must
        keep reaping), and retire the old one once the new one is ready."""
        self._renewing.set()
        threading.Thread(target=self._renew_zygote_now, name="zygote-renew", daemon=True).start()

    def _renew_zygote_now(self) -> None:
        try:
            fresh = Zygote(self.spec, self.listen.fileno()).wait_ready()
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

    # ---- restarts -----------------------------------------------------------------------

    def restart(self, now: bool, drain_timeout: float) -> None:
        """Replace every worker and spare, with the code installed now. now: kill them all,
        the watcher refills at once. Otherwise one slot at a time: the replacement warms up,
        takes the slot before the old worker drains when the device has room for both
        KV caches, else right after the old one has drained and exited."""
        if self.zygote is not None:
            while self._renewing.is_set():  # a renewal the watcher started
                time.sleep(0.05)
            if code_version() != self.zygote.version:
                log.info("installed code changed; renewing the zygote before restarting")
                self._renewing.set()
                self._renew_zygote_now()
        with self._lock:
            for w in self._spares():  # they run the code of before, too
                w.retiring = True
                _signal(w.pid, signal.SIGTERM)
            if now:
                for w in list(self.workers.values()):
                    if w.slot is not None and not w.retiring:
                        w.retiring = True
                        self.slots[w.slot].restarts += 1
                        _signal(w.pid, signal.SIGKILL)
                return
            # workers already on their way out (an earlier restart) are not replaced twice
            current = sorted((w for w in self.workers.values() if w.slot is not None and not w.retiring), key=lambda w: w.slot)
        for old in current:
            self._replace(old, drain_timeout)

    def _replace(self, old: Worker, drain_timeout: float) -> None:
        fresh = self._spawn(old.slot)
        with self._lock:
            old.retiring = True  # the watcher must not refill this slot meanwhile
            self.slots[old.slot].restarts += 1
        if not self.wait_state([fresh.pid], "standby", timeout=120):
            log.error("replacement for worker %d did not warm up; keeping the old one", old.slot)
            self._abandon(fresh, old)
            return
        if self.room_for(old.kv_cache_bytes):
            self._go(fresh)
            if not self.wait_state([fresh.pid], "ready", timeout=120):
                log.error("replacement for worker %d did not become ready; keeping the old one", old.slot)
                self._abandon(fresh, old)
                return
            self._drain(old, drain_timeout)
        else:
            log.info("no room for a second KV cache: worker %d drains before its replacement takes over", old.slot)
            self._drain(old, drain_timeout)
            self._go(fresh)
            if not self.wait_state([fresh.pid], "ready", timeout=120):
                log.error("replacement for worker %d did not become ready; the watcher replaces it", old.slot)

    def _abandon(self, fresh: Worker, old: Worker) -> None:
        with self._lock:
            fresh.retiring, old.retiring = True, False  # its death is not the slot's failure
        _signal(fresh.pid, signal.SIGKILL)

    def _drain(self, worker: Worker, drain_timeout: float) -> None:
        worker.state = "draining"
        _signal(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + drain_timeout + 5
        while worker.pid in self.workers and time.monotonic() < deadline:
            time.sleep(0.01)
        if worker.pid in self.workers:
            _signal(worker.pid, signal.SIGKILL)
            while worker.pid in self.workers and time.monotonic() < deadline + 5:
                time.sleep(0.01)

    def status(self) -> list[dict]:
        with self._lock:
            now = time.monotonic()
            by_slot = {w.slot: w for w in self.workers.values() if w.slot is not None and not w.retiring}
            return [
                {
                    "slot": slot,
                    "pid": by_slot[slot].pid if slot in by_slot else None,
                    "state": by_slot[slot].state if slot in by_slot else vacancy(info),
                    "uptime_s": round(now - by_slot[slot].started, 3) if slot in by_slot else 0.0,
                    "restarts": info.restarts,
                    "last_exit": info.last_exit,
                    "consecutive_failures": info.failures,
                    "kv_cache_bytes": by_slot[slot].kv_cache_bytes if slot in by_slot else 0,
                }
                for slot, info in enumerate(self.slots)
            ]

    def spare_status(self) -> list[dict]:
        with self._lock:
            now = time.monotonic()
            return [{"pid": w.pid, "state": w.state, "uptime_s": round(now - w.started, 3)} for w in self._spares()]

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=2)
        with self._lock:
            pids = list(self.workers)
            for w in self.workers.values():
                if w.go is not None:
                    os.close(w.go)  # a spare reads EOF: nothing to serve
                    w.go = None
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


def vacancy(info: Slot) -> str:
    """The state of a slot without a worker."""
    if info.failures > 1:
        return "backoff"
    return "restarting" if info.last_exit else "starting"


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
