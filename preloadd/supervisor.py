"""Supervision of engine workers, in the style of gunicorn's arbiter: one thread owns
every worker record and runs one loop; other threads only queue requests and read the
snapshot it publishes. No lock is held across IPC or a fork.

Each turn waits (selectors, at most TICK seconds) on: a wake-up pipe for queued
requests (restart, stop), each worker's pidfd (readable once it exits) and link socket
(its reports and beats), the zygotes' pidfds, and a starting zygote's socket. Then, in
order: reap orphans, kill workers that hang, advance a rolling restart, renew the
zygote when the code changed, fill empty slots and spares, publish the snapshot.

The daemon owns the API listening socket and every worker inherits it, so a client
that connects while a worker restarts waits in the kernel's backlog instead of being
refused. The daemon is a child subreaper: workers (double-forked by the zygote) are
its children, reaped here by pid, the zygote through its own Popen.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import queue
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from preload.options import DaemonOptions, ServeOptions
from preload.preloadd import zygote as zyg
from preload.preloadd.rolling import RollingRestart
from preload.preloadd.workers import MAX_BACKOFF, Slot, Worker, describe_exit, reap, reap_orphans

log = logging.getLogger("preload.daemon")

PR_SET_CHILD_SUBREAPER = 36
TICK = 0.25  # seconds between turns when nothing happens: deadlines are this precise
CODE_CHECK_INTERVAL = 2.0
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def become_subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def code_version() -> str:
    """Changes when the installed preload code changes: the zygote must then be renewed."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        if ".venv" not in path.parts and "tests" not in path.parts:
            st = path.stat()
            h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


class Supervisor:
    """Keeps `opts.workers` workers serving and `spares` warm spare workers beside them.
    A spare has attached, warmed up and waits for a slot; when a worker dies the spare
    takes its slot at once, and a new spare warms up. `room_for(kv_bytes)` says whether
    the device has room for one more KV cache of that size, so that a rolling restart can
    run old and new side by side."""

    def __init__(self, opts: DaemonOptions, serve: ServeOptions, spares: int, listen: socket.socket,
                 room_for: Callable[[int], bool] = lambda kv_bytes: True):
        self.opts, self.spares, self.listen, self.room_for = opts, spares, listen, room_for
        self.spec = zyg.worker_spec(serve)
        self.workers: dict[int, Worker] = {}  # by pid
        self.slots = [Slot() for _ in range(opts.workers)]
        self.spare_pool = Slot()  # restarts and backoff of the spares
        self.zygote: zyg.Zygote | None = None  # ready to fork
        self.pending: zyg.Zygote | None = None  # importing
        self.retired: list[zyg.Zygote] = []  # told to exit, not reaped yet
        self.zygote_restarts = 0
        self.zygote_error: str | None = None  # the first zygote died: no worker can ever start
        self._had_zygote = False
        self._zygote_failures = 0
        self._zygote_next = 0.0  # backoff after a zygote died before it was ready
        self.rolling: RollingRestart | None = None
        self._restart_queued = False
        self._stopping: float | None = None  # the stop's deadline
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self._code_checked = time.monotonic()
        self._snapshot: dict = {"workers": [], "spares": [], "zygote_restarts": 0}
        self._published = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    # ---- the daemon's side: start, wait, queue requests, read the snapshot --------------------

    def prepare(self) -> None:
        """Launch the zygote now: its imports then overlap whatever the daemon does before
        `start` (loading the weights)."""
        become_subreaper()
        if self.opts.zygote:
            self._start_zygote()

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def wait_started(self, timeout: float) -> str | None:
        """Wait until every slot has a ready worker: None, or why that will not happen."""
        deadline = time.monotonic() + timeout
        with self._published:
            while True:
                s = self._snapshot
                if s.get("zygote_error"):
                    return s["zygote_error"]
                failed = [w for w in s["workers"] if w["restarts"]]
                if failed:
                    return f"worker {failed[0]['slot']} {failed[0]['last_exit']} before it was ready"
                if all(w["state"] == "ready" for w in s["workers"]):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"workers not ready within {timeout:.0f} s"
                self._published.wait(left)

    def restart(self, now: bool) -> None:
        self._request(("restart", now))

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker, wait up to `timeout` for them to drain, SIGKILL the rest."""
        if self._thread.ident is None:
            self._thread.start()  # never started (the load failed): the loop still cleans up
        self._request(("stop", timeout))
        self._thread.join(timeout + 15)

    def status(self) -> dict:
        return self._snapshot

    def _request(self, item: tuple) -> None:
        self._requests.put(item)
        os.write(self._wake_w, b"x")

    # ---- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._turn():
                    return
            except Exception:  # noqa: BLE001 - a bug in one turn must not leave the workers unsupervised
                log.exception("supervisor turn failed")
                time.sleep(TICK)

    def _turn(self) -> bool:
        """One turn of the loop; True when stopped."""
        for key, _ in self._sel.select(TICK):
            key.data()
        while not self._requests.empty():
            self._handle(*self._requests.get())
        reap_orphans(self._known_pids())
        if self._stopping is not None:
            return self._stop_turn()
        self._check_liveness()
        try:
            self._advance_restart()
            self._check_zygote()
            self._refill()
        except (OSError, RuntimeError) as e:
            log.error("cannot start a worker: %s", e)
            for info in (*self.slots, self.spare_pool):
                info.next_start = max(info.next_start, time.monotonic() + 1.0)
        self._publish()
        return False

    def _advance_restart(self) -> None:
        if self.rolling is not None and self.rolling.advance(self):
            self.rolling = None
            if self._restart_queued:
                self._restart_queued = False
                self.rolling = RollingRestart(self)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _handle(self, op: str, arg) -> None:
        if op == "stop":
            self._begin_stop(arg)
        elif op == "restart" and self._stopping is None:
            if arg:
                self._restart_now()
            elif self.rolling is None:
                self.rolling = RollingRestart(self)
            else:
                self._restart_queued = True  # after this one: it replaces what this one started

    def _known_pids(self) -> set[int]:
        zygotes = [z for z in (self.zygote, self.pending, *self.retired) if z is not None]
        return set(self.workers) | {z.pid for z in zygotes}

    # ---- workers: start, tell, hear, reap -----------------------------------------------------

    def spawn(self, slot: int | None) -> Worker:
        """Fork a worker for `slot` (it waits for its go all the same) or a spare."""
        proc = None
        if self.opts.zygote:
            if self.zygote is None:
                raise RuntimeError("no zygote is ready")
            try:
                pid, link = self.zygote.fork(slot)
            except RuntimeError:
                self._zygote_gone(self.zygote, kill=True)
                raise
        else:
            proc, link = zyg.spawn_fresh(self.spec, slot, self.listen.fileno())
            pid = proc.pid
        link.setblocking(False)
        worker = self.workers[pid] = Worker(pid, link, os.pidfd_open(pid), slot, proc)
        self._sel.register(worker.pidfd, selectors.EVENT_READ, lambda: self._reap(worker))
        self._sel.register(worker.link, selectors.EVENT_READ, lambda: self._hear(worker))
        log.info("%s started (pid %d)", worker.name, pid)
        return worker

    def go(self, worker: Worker) -> None:
        """Tell a worker (forked for its slot, or a spare just given one) to serve its slot."""
        worker.told, worker.state, worker.since = True, "starting", time.monotonic()
        worker.stamps["slot_given"] = time.time()
        try:
            worker.link.send(json.dumps({"slot": worker.slot}).encode())
        except OSError:
            pass  # it died meanwhile: its pidfd says so

    def drain(self, worker: Worker, drain_timeout: float) -> None:
        """SIGTERM: it stops accepting, finishes what it has (up to its drain timeout) and exits."""
        worker.retiring, worker.state = True, "draining"
        worker.deadline = time.monotonic() + drain_timeout + 5
        worker.stamps["signalled"] = time.time()
        worker.signal(signal.SIGTERM)

    def retire_spare(self, worker: Worker) -> None:
        """A spare reads EOF on its link and exits."""
        worker.retiring = True
        self._unregister(worker.link)
        worker.link.close()

    def _unregister(self, fileobj) -> None:
        try:
            self._sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass  # not registered (any more)

    def _hear(self, worker: Worker) -> None:
        for _ in range(16):
            try:
                data = worker.link.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # it closed its end: it is exiting, and its pidfd will say when
                self._unregister(worker.link)
                return
            try:
                msg = json.loads(data)
                self._on_message(worker, msg["event"], msg)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("%s (pid %d) sent a malformed message (%s): %r", worker.name, worker.pid, e, data[:200])

    def _on_message(self, w: Worker, event: str, msg: dict) -> None:
        now = time.monotonic()
        w.heard = now
        if event == "beat":
            steps, busy = int(msg["steps"]), bool(msg["busy"])
            if steps != w.steps or not busy:
                w.progress_at = now
            w.steps, w.busy = steps, busy
        elif event == "warm" and not w.told:
            w.state, w.stamps["warm"] = "standby", time.time()
            if w.slot is None:
                self.spare_pool.failures = 0
        elif event == "ready" and w.told and w.slot is not None:
            w.state, w.kv_cache_bytes, w.stamps["ready"] = "ready", int(msg.get("kv_cache_bytes", 0)), time.time()
            self.slots[w.slot].failures = 0  # the slot is out of any crash loop
            log.info("worker %d ready (pid %d) %.3f s after start", w.slot, w.pid, now - w.since)

    def _reap(self, worker: Worker) -> None:
        code = reap(worker)
        if code is None:
            return
        del self.workers[worker.pid]
        self._unregister(worker.pidfd)
        self._unregister(worker.link)
        worker.close()
        reason = describe_exit(code)
        if worker.kill_reason:
            reason = f"{reason} ({worker.kill_reason})"
        worker.stamps["reaped"] = time.time()
        if worker.relief:
            log.error("replacement for worker %d (pid %d) %s before taking over; the old one keeps serving",
                      worker.slot, worker.pid, reason)
            return
        record = self.spare_pool if worker.slot is None else self.slots[worker.slot]
        if worker.retiring:
            record.last_exit = reason
            if worker.slot is not None and record.replacement.get("old_pid") == worker.pid:
                record.replacement["old_reaped"] = worker.stamps["reaped"]
            return
        delay = record.record_exit(worker, reason)
        if worker.slot is not None:
            record.replaced(f"exit: {reason}", worker, reaped=worker.stamps["reaped"])
        log.warning("%s (pid %d) %s; %s", worker.name, worker.pid, reason,
                    f"restarting in {delay:.1f} s (crash loop)" if delay else "restarting now")

    # ---- liveness -----------------------------------------------------------------------------

    def _check_liveness(self) -> None:
        now, o = time.monotonic(), self.opts
        for w in list(self.workers.values()):
            if w.kill_reason:
                continue
            if w.state == "draining":
                why = f"still draining {o.worker.drain_timeout + 5:.0f} s after SIGTERM" if now > w.deadline else None
            elif w.state in ("warming", "starting") and now - w.since > o.worker_start_timeout:
                why = f"hung: not {'warm' if w.state == 'warming' else 'ready'} within {o.worker_start_timeout:g} s"
            elif w.heard is not None and now - w.heard > o.worker_timeout:
                why = f"hung: no heartbeat for {now - w.heard:.1f} s"
            elif w.busy and now - w.progress_at > o.engine_step_timeout:
                why = f"hung: its engine had work and made no step for {now - w.progress_at:.1f} s"
            else:
                why = None
            if why:
                log.warning("%s (pid %d) %s; killing it", w.name, w.pid, why)
                w.kill(why)

    # ---- filling slots and spares -------------------------------------------------------------

    def holder(self, slot: int) -> Worker | None:
        return next((w for w in self.workers.values() if w.holds(slot)), None)

    def idle_spares(self) -> list[Worker]:
        """Spares that could take a slot, the warmest first."""
        spares = [w for w in self.workers.values() if w.slot is None and not w.retiring]
        return sorted(spares, key=lambda w: (w.state != "standby", w.since))

    def _refill(self) -> None:
        now = time.monotonic()
        for slot, info in enumerate(self.slots):
            if self.holder(slot) is None and now >= info.next_start:
                self._fill(slot)
        starting = any(w.slot is not None and w.state != "ready" and not w.retiring for w in self.workers.values())
        # Spares warm up while no worker is starting, so that they never slow down one that is.
        if (not starting and len(self.idle_spares()) < self.spares and now >= self.spare_pool.next_start
                and self._can_fork()):
            self.spawn(None)

    def _can_fork(self) -> bool:
        return not self.opts.zygote or self.zygote is not None

    def _fill(self, slot: int) -> None:
        """Put a worker in a vacant slot: a spare if there is one, else a fresh fork."""
        spares = self.idle_spares()
        if spares:
            worker, via = spares[0], "spare"
            worker.slot = slot
            log.info("spare (pid %d, %s) takes slot %d", worker.pid, worker.state, slot)
        elif self._can_fork():
            worker, via = self.spawn(slot), "fork"
        else:
            return  # a zygote is on its way
        info = self.slots[slot]
        if not info.replacement or info.successor is not None:
            info.replaced("start", None)
        info.replacement["via"], info.successor = via, worker
        self.go(worker)

    def _restart_now(self) -> None:
        if self.rolling is not None:
            self.rolling.cancel(self)
            self.rolling = None
        self._restart_queued = False
        for w in list(self.workers.values()):
            if w.slot is None and not w.retiring:
                self.retire_spare(w)
            elif w.slot is not None and w.holds(w.slot):
                w.retiring = True
                info = self.slots[w.slot]
                info.restarts += 1
                w.kill("restart --now")
                info.replaced("restart --now", w)

    # ---- the zygote ---------------------------------------------------------------------------

    def _start_zygote(self) -> None:
        z = self.pending = zyg.Zygote(self.spec, self.listen.fileno(), code_version())
        self._sel.register(z.pidfd, selectors.EVENT_READ, lambda: self._zygote_exited(z))
        self._sel.register(z.sock, selectors.EVENT_READ, lambda: self._zygote_ready(z))

    def _zygote_ready(self, z: zyg.Zygote) -> None:
        self._unregister(z.sock)
        if not z.accept_ready():
            return  # it died instead: its pidfd says so
        old, self.zygote, self.pending = self.zygote, z, None
        self._zygote_failures = 0
        if self._had_zygote:
            self.zygote_restarts += 1
            log.info("zygote ready (pid %d), replacing one that %s", z.pid, "was outdated" if old else "died")
        self._had_zygote = True
        if old is not None:
            self._zygote_gone(old)

    def _zygote_gone(self, z: zyg.Zygote, kill: bool = False) -> None:
        """Stop using a zygote; it exits (killed, if it no longer answers) and is reaped later."""
        if self.zygote is z:
            self.zygote = None
        z.retire()
        if kill:
            z.proc.kill()
        self.retired.append(z)

    def _zygote_exited(self, z: zyg.Zygote) -> None:
        if z.proc.poll() is None:
            return
        self._unregister(z.pidfd)
        self._unregister(z.sock)
        z.close()
        if z in self.retired:
            self.retired.remove(z)
            return
        log.warning("zygote (pid %d) exited with status %s; starting a new one", z.pid, z.proc.returncode)
        if self.zygote is z:
            self.zygote = None
        if self.pending is z:
            self.pending = None
            self._zygote_failures += 1
            if not self._had_zygote:  # it never got as far as its imports: the next one would not either
                self.zygote_error = f"the zygote exited with status {z.proc.returncode} before it was ready"
        f = self._zygote_failures
        self._zygote_next = time.monotonic() + (min(0.5 * 2 ** (f - 1), MAX_BACKOFF) if f else 0.0)

    def _check_zygote(self) -> None:
        if not self.opts.zygote or self.pending is not None or self.zygote_error:
            return
        if self.zygote is None:
            if time.monotonic() >= self._zygote_next:
                self._start_zygote()
        elif time.monotonic() - self._code_checked > CODE_CHECK_INTERVAL:
            self._code_checked = time.monotonic()
            if code_version() != self.zygote.version:
                log.info("installed code changed; renewing the zygote")
                self._start_zygote()

    def zygote_current(self) -> bool:
        """Whether forks run the code installed now (a restart waits for that)."""
        if not self.opts.zygote:
            return True
        if self.pending is None and self.zygote is not None and code_version() != self.zygote.version:
            log.info("installed code changed; renewing the zygote before restarting")
            self._start_zygote()
        return self.pending is None and self.zygote is not None

    # ---- stopping -----------------------------------------------------------------------------

    def _begin_stop(self, timeout: float) -> None:
        self._stopping = time.monotonic() + timeout
        for w in list(self.workers.values()):
            w.retiring = True  # exits from here on are expected
            if w.told:
                w.signal(signal.SIGTERM)
            else:
                self.retire_spare(w)  # waiting for a slot: EOF ends it

    def _stop_turn(self) -> bool:
        """One turn of stopping; True once every worker is reaped and the zygotes are gone."""
        if self.workers and time.monotonic() < self._stopping:
            return False
        for w in list(self.workers.values()):
            w.kill("daemon stopping")
            reap(w, block=True)
            w.close()
        self.workers.clear()
        for z in (self.zygote, self.pending, *self.retired):
            if z is not None:
                z.retire()
                try:
                    z.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # a zygote that does not exit on EOF is killed
                    z.proc.kill()
                    z.proc.wait()
                z.close()
        self._publish()
        return True

    # ---- /status ------------------------------------------------------------------------------

    def _publish(self) -> None:
        now = time.monotonic()
        workers = []
        for slot, info in enumerate(self.slots):
            w = self.holder(slot)
            workers.append({
                "slot": slot,
                "pid": w and w.pid,
                "state": w.state if w else info.vacancy(),
                "uptime_s": round(now - w.since, 3) if w else 0.0,
                "restarts": info.restarts,
                "last_exit": info.last_exit,
                "consecutive_failures": info.failures,
                "kv_cache_bytes": w.kv_cache_bytes if w else 0,
                "last_replacement": info.published_replacement(),
            })
        spares = [{"pid": w.pid, "state": w.state, "uptime_s": round(now - w.since, 3), "forked": w.stamps["forked"],
                   "warm": w.stamps.get("warm")} for w in self.idle_spares()]
        with self._published:
            self._snapshot = {"workers": workers, "spares": spares, "zygote_restarts": self.zygote_restarts,
                              "zygote_error": self.zygote_error}
            self._published.notify_all()
