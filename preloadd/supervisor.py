"""Supervision of engine workers, in the style of gunicorn's arbiter: one thread owns
every worker record and runs one loop; other threads only queue requests and read the
snapshot it publishes. No lock is held across IPC or a fork.

Each turn waits (selectors, at most TICK seconds) on: a wake-up pipe for queued
requests (restart, stop), each worker's pidfd (readable once it exits) and link socket
(its reports and beats), the zygotes' pidfds, and a starting zygote's socket. Then, in
order: reap orphans, kill workers that hang, advance a rolling restart, renew the
zygote when the code changed, fill empty slots and spares, publish the snapshot.

Each slot is two processes (worker/serve.py): its engine core (what "worker" means
below: the model, the KV cache; spares are cores) and its front (HTTP and the requests'
state). A front outlives its slot's cores: when a core dies, a spare or a fresh core takes
the slot and the front hands it the requests (worker/front.py); a front that dies is
started again (its connections are lost: the one case that loses requests).

The daemon owns the API listening socket and every front inherits it: a client that
connects while a front restarts waits in the kernel's backlog. The daemon is a child
subreaper: workers (double-forked by the zygote) are reaped here by pid, the zygote
through its own Popen.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable

from preload.ipc.protocol import slot_socket_path
from preload.options import BUNDLED_MODEL, DaemonOptions, ServeOptions
from preload.preloadd import zygote as zyg
from preload.preloadd.health import worker_gone
from preload.preloadd.orphans import Adoption
from preload.preloadd.rolling import RollingRestart, restart_now
from preload.preloadd.sleeping import KEPT, cores_left, on_kept_event, sleep_message, sleep_request, tell
from preload.preloadd.workers import (OwnStalls, Slot, Worker, become_subreaper, close_fds, describe_exit, drain_pipe,
                                      reap, reap_orphans, unregister)

log = logging.getLogger("preload.daemon")

TICK = 0.25  # seconds between turns when nothing happens: deadlines are this precise


class Supervisor:
    """Keeps `opts.workers` workers serving and `spares` warm spares beside them, on each of
    `dp_ranks` copies of the weights. A spare has attached, warmed up and waits for a slot of
    its rank; when a worker dies the spare takes its slot at once, and a new spare warms up.
    `room_for(kv_bytes, dp_rank)`: whether the rank's device has room for one more KV cache,
    so that a rolling restart runs old and new side by side. `zygote`: the first zygote
    (zygote.launch_early); `gpu`: the workers run on a GPU (their zygote imports Triton)."""

    def __init__(self, opts: DaemonOptions, serve: ServeOptions, spares: int, listen: socket.socket,
                 room_for: Callable[[int, int], bool] = lambda kv_bytes, dp_rank: True,
                 zygote: zyg.Zygote | None = None, gpu: bool = False, dp_ranks: int = 1):
        self.opts, self.spares, self.listen, self.room_for = opts, spares, listen, room_for
        self.spec = zyg.worker_spec(serve, gpu, opts.model or BUNDLED_MODEL)
        self.workers: dict[int, Worker] = {}  # by pid
        self.dp_ranks = dp_ranks
        self.slots = [Slot() for _ in range(opts.workers * dp_ranks)]
        self.front_slots = [Slot() for _ in self.slots]  # the fronts' restarts and backoff
        self.spare_pool = Slot()  # restarts and backoff of the spares
        self.zygotes = zyg.Zygotes(self.spec, listen.fileno(), opts.state_dir, zygote) if opts.zygote else None
        self.rolling: RollingRestart | None = None
        self.adoption: Adoption | None = None
        self._restart_queued = False
        self.asleep: int | None = None  # the sleep's level (preloadd/sleeping.py): no core runs
        self._stopping: float | None = None  # the stop's deadline
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, lambda: drain_pipe(self._wake_r))
        self._snapshot: dict = {"workers": [], "spares": [], "zygote_restarts": 0}
        self._own_stalls = OwnStalls(TICK)
        self._published = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    # ---- the daemon's side: start, wait, queue requests, read the snapshot --------------------

    def prepare(self) -> None:
        """Launch the zygote now: its imports then overlap whatever the daemon does before
        `start` (loading the weights)."""
        become_subreaper()
        if self.zygotes:
            self.zygotes.start(self._sel)

    def start(self, adoption: Adoption | None = None) -> None:
        """Run the loop; with `adoption`, take over the workers a dead daemon left."""
        self.adoption = adoption
        if adoption is not None:
            self._sel.register(adoption.listener, selectors.EVENT_READ, self._take_orphan)
        self._publish()
        self._thread.start()
        self._wake()  # its first turn starts the workers now, not after a turn's wait for events

    def wait_started(self, timeout: float) -> str | None:
        """Wait until every slot has a ready worker: None, or why that will not happen. A
        worker's `timeout` counts from its own start (one not ready by then is killed as hung,
        `_check_liveness`, and that fails the start); before it, a worker waits for the
        zygote's imports, seconds of a cold start, which get zygote.IMPORTS_TIMEOUT if longer."""
        waited = max(timeout, zyg.IMPORTS_TIMEOUT)
        deadline = time.monotonic() + waited
        with self._published:
            while True:
                s = self._snapshot
                if s.get("zygote_error"):
                    return s["zygote_error"]
                failed = [w for w in s["workers"] if w["restarts"]]
                if failed:
                    return f"worker {failed[0]['slot']} {failed[0]['last_exit']} before it was ready"
                failed = [w for w in s["workers"] if w["front"]["restarts"]]
                if failed:
                    return f"front {failed[0]['slot']} {failed[0]['front']['last_exit']} before it was ready"
                if all(w["state"] == "ready" and w["front"]["state"] == "ready" for w in s["workers"]):
                    return None
                left = deadline - time.monotonic()
                if left <= 0 and not all(w["pid"] for w in s["workers"]):
                    return f"workers not started within {waited:.0f} s"
                self._published.wait(max(left, 0.5))

    def restart(self, now: bool) -> None:
        self._request(("restart", now))

    def sleep(self, level: int | None, keep_spares: bool = False) -> None:
        """Let every core go (level: 1 or 2; `keep_spares`: the warm spares let go of the
        weights alone), or (None) fill the slots again; `kept`: asks of the spares kept."""
        self._request(("sleep", (level, keep_spares)) if level else ("wake", None))

    def kept(self, op: str, arg) -> None:
        self._request(("kept", (op, arg)))

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
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # stopped (the pipe is closed), or a wake-up is pending already (the pipe is full)

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
        self._own_stalls.excuse(self.workers.values())
        while not self._requests.empty():
            self._handle(*self._requests.get())
        reap_orphans(self._known_pids())
        if self._stopping is not None:
            return self._stop_turn()
        self._check_liveness()
        try:
            self._advance_restart()
            if self.zygotes:
                self.zygotes.check(self._sel)
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

    def _handle(self, op: str, arg) -> None:
        if op == "stop":
            self._begin_stop(arg)
        elif op in ("sleep", "wake", "kept") and self._stopping is None:
            sleep_request(self, op, arg)
        elif op == "restart" and self._stopping is None and self.asleep is None:
            if arg:
                restart_now(self)
            elif self.rolling is None:
                self.rolling = RollingRestart(self)
            else:
                self._restart_queued = True  # after this one: it replaces what this one started

    def _known_pids(self) -> set[int]:
        return set(self.workers) | (self.zygotes.pids() if self.zygotes else set())

    # ---- workers: start, tell, hear, reap -----------------------------------------------------

    def dp_rank(self, slot: int) -> int:  # (whose copy of the weights the slot's core maps)
        return slot // self.opts.workers

    def spawn(self, slot: int | None, role: str = "core", dp_rank: int = 0) -> Worker:
        """Fork a core for `slot` (it waits for its go all the same), a spare core of
        `dp_rank`, or the front of `slot` (it starts at once)."""
        proc, dp_rank = None, dp_rank if slot is None else self.dp_rank(slot)
        if self.zygotes:
            pid, link = self.zygotes.fork(slot, role, dp_rank)
        else:
            proc, link = zyg.spawn_fresh(self.spec, slot, self.listen.fileno(), role, dp_rank)
            pid = proc.pid
        worker = self.adopt(Worker(pid, link, os.pidfd_open(pid), slot, proc, role=role, dp_rank=dp_rank))
        if role == "front":
            worker.told, worker.state = True, "starting"
        log.info("%s started (pid %d)", worker.name, pid)
        return worker

    def adopt(self, worker: Worker) -> Worker:
        """Watch a worker process: its exit (pidfd) and what it says (link)."""
        worker.link.setblocking(False)
        self.workers[worker.pid] = worker
        if worker.role == "front":  # (one adopted from a daemon that died asleep is told it is not)
            tell(worker, sleep_message(self.asleep))
        self._sel.register(worker.pidfd, selectors.EVENT_READ, lambda: self._reap(worker))
        self._sel.register(worker.link, selectors.EVENT_READ, lambda: self._hear(worker))
        return worker

    def _take_orphan(self) -> None:
        """An orphan calls: supervise it again as its slot's worker, or have it retire."""
        got = self.adoption.listener.accept()
        if got is None:
            return
        conn, claim, fds = got
        front = claim.get("role") == "front"
        vacant = (lambda slot: self.front_of(slot) is None) if front else (lambda slot: self.holder(slot) is None)
        why = self.adoption.verdict(claim, len(self.slots), vacant, self.dp_rank)
        if why is None and self._stopping is not None:
            why = "the daemon is stopping"
        try:
            pidfd = os.pidfd_open(claim["pid"])
            conn.send(json.dumps({"adopted": True} if why is None else {"retire": why}).encode())
        except OSError:
            conn.close()
            close_fds(fds)
            return  # it is gone already
        if why is None and not front:
            try:
                self.slots[claim["slot"]].keep_kv(fds, claim)
            except (KeyError, TypeError, ValueError) as e:  # (its fds are closed: the slot's next worker makes new memory)
                log.warning("pid %d sent its KV memory without its sizes (%s); not kept", claim["pid"], e)
        else:
            close_fds(fds)
        self.adopt(Worker.orphan(claim, conn, pidfd, why, self.opts.worker.drain_timeout))

    def go(self, worker: Worker) -> None:
        """Tell a worker (forked for its slot, or a spare just given one) to serve its slot."""
        worker.told, worker.state, worker.since = True, "starting", time.monotonic()
        worker.stamps["slot_given"] = time.time()
        info = self.slots[worker.slot]
        kv, cause = info.kv, info.replacement.get("cause", "start")
        # (what its front is told of the last core: died, or replaced on purpose)
        takeover = "died" if cause.startswith("exit") else "first" if cause == "start" else "restart"
        msg = {"slot": worker.slot, "takeover": takeover} | (
            {"kv_cache_bytes": kv[1], "kv_memory_bytes": kv[2]} if kv else {})
        try:
            socket.send_fds(worker.link, [json.dumps(msg).encode()], [kv[0]] if kv else [])
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
        unregister(self._sel, worker.link)
        worker.link.close()

    def zygote_current(self) -> bool:
        """Whether forks run the code installed now (a restart waits for that)."""
        return not self.zygotes or self.zygotes.current(self._sel)

    def _hear(self, worker: Worker) -> None:
        for _ in range(16):
            try:
                data, fds, _, _ = socket.recv_fds(worker.link, 1 << 16, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:  # it closed its end: it is exiting, and its pidfd will say when
                close_fds(fds)
                unregister(self._sel, worker.link)
                return
            try:
                msg = json.loads(data)
                event = msg["event"]
            except (ValueError, KeyError, TypeError) as e:
                close_fds(fds)
                log.warning("%s (pid %d) sent a malformed message (%s): %r", worker.name, worker.pid, e, data[:200])
                continue
            try:
                self._on_message(worker, event, msg, fds)  # (takes the fds: keeps or closes them)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("%s (pid %d) sent a malformed message (%s): %r", worker.name, worker.pid, e, data[:200])

    def _on_message(self, w: Worker, event: str, msg: dict, fds: list[int]) -> None:
        if event == "ready" and w.told and w.slot is not None and w.role == "core":
            self.slots[w.slot].keep_kv(fds, msg)  # (its KV memory, for the slot's next worker)
        else:
            close_fds(fds)  # nothing else comes with fds
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
                self.spare_pool.ready()
        elif event == "ready" and w.told and w.slot is not None:
            w.state, w.kv_cache_bytes, w.stamps["ready"] = "ready", int(msg.get("kv_cache_bytes", 0)), time.time()
            (self.front_slots if w.role == "front" else self.slots)[w.slot].ready()
            log.info("%s ready (pid %d) %.3f s after start", w.name, w.pid, now - w.since)
        elif event in ("released", "remapped", "kept_failed") and w.slot is None:
            on_kept_event(self, w, event, msg)

    def _reap(self, worker: Worker) -> None:
        code = reap(worker) if worker.pid in self.workers else None
        if code is None:
            return
        del self.workers[worker.pid]
        worker_gone(worker.pid)
        unregister(self._sel, worker.pidfd)
        unregister(self._sel, worker.link)
        worker.close()
        reason = describe_exit(code)
        if worker.kill_reason:
            reason = f"{reason} ({worker.kill_reason})"
        worker.stamps["reaped"] = time.time()
        if worker.relief:
            log.error("replacement for worker %d (pid %d) %s before taking over; the old one keeps serving",
                      worker.slot, worker.pid, reason)
            return
        if worker.role == "front":  # (the channel it bound goes with it, unless a successor bound the path since)
            if self.opts.state_dir is not None and self.front_of(worker.slot) is None:
                slot_socket_path(self.opts.state_dir, worker.slot).unlink(missing_ok=True)
            record = self.front_slots[worker.slot]
        else:
            record = self.spare_pool if worker.slot is None else self.slots[worker.slot]
        if worker.retiring:
            record.last_exit = reason
            log.info("%s (pid %d) %s", worker.name, worker.pid, reason)
            if worker.slot is not None and record.replacement.get("old_pid") == worker.pid:
                record.replacement["old_reaped"] = worker.stamps["reaped"]
            return
        delay = record.record_exit(worker, reason, own=code > 0)
        if worker.slot is not None and worker.role == "core":
            record.replaced(f"exit: {reason}", worker, reaped=worker.stamps["reaped"])
        log.warning("%s (pid %d) %s; %s", worker.name, worker.pid, reason,
                    f"restarting in {delay:.1f} s (crash loop)" if delay else "restarting now")

    # ---- liveness -----------------------------------------------------------------------------

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):
            why = w.hung(self.opts, now) if not w.kill_reason else None
            if why:
                log.warning("%s (pid %d) %s; killing it", w.name, w.pid, why)
                w.kill(why)

    # ---- filling slots and spares -------------------------------------------------------------

    def holder(self, slot: int) -> Worker | None:
        """The core of `slot`."""
        return next((w for w in self.workers.values() if w.holds(slot)), None)

    def front_of(self, slot: int) -> Worker | None:
        return next((w for w in self.workers.values() if w.fronts(slot)), None)

    def idle_spares(self, dp_rank: int | None = None) -> list[Worker]:
        """Spares that could take a slot (of `dp_rank`, if given), the warmest first."""
        spares = [w for w in self.workers.values() if w.slot is None and not w.retiring and w.role == "core"
                  and dp_rank in (None, w.dp_rank)]
        return sorted(spares, key=lambda w: (w.state != "standby", w.since))

    def _refill(self) -> None:
        now = time.monotonic()
        # Cores first: a slot waits for its core's start, the longer (its front's runs beside it).
        for slot, info in enumerate(self.slots if self.asleep is None else ()):  # (asleep: no core, no spare)
            if self.holder(slot) is None and now >= info.next_start:
                if self.adoption is not None and self.adoption.waiting_for(slot):
                    continue  # its orphan lives and will call
                self._fill(slot)
        for slot, info in enumerate(self.front_slots):
            if self.front_of(slot) is None and now >= info.next_start and self._can_fork():
                if self.adoption is not None and self.adoption.waiting_for(slot, "front"):
                    continue  # its orphan lives and will call
                self.spawn(slot, "front")
        starting = any(w.slot is not None and w.state != "ready" and not w.retiring and w.role == "core"
                       for w in self.workers.values())
        # Spares warm up while no worker is starting, so that they never slow down one that is.
        short = [k for k in range(self.dp_ranks) if len(self.idle_spares(k)) < self.spares]
        if self.asleep is None and not starting and short and now >= self.spare_pool.next_start and self._can_fork():
            self.spawn(None, dp_rank=short[0])

    def _can_fork(self) -> bool:
        return not self.zygotes or self.zygotes.ready is not None

    def _fill(self, slot: int) -> None:
        """Put a worker in a vacant slot: a spare if there is one, else a fresh fork."""
        # (Not a kept spare that has not mapped the weights again: preloadd/sleeping.py.)
        spares = [w for w in self.idle_spares(self.dp_rank(slot)) if w.state not in KEPT]
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

    # ---- stopping -----------------------------------------------------------------------------

    def _begin_stop(self, timeout: float) -> None:
        self._stopping = time.monotonic() + timeout
        for w in list(self.workers.values()):
            w.retiring = True  # exits from here on are expected
            if w.told:
                w.signal(signal.SIGTERM)
            elif w.state in KEPT:  # (its weights let go: nothing to drain, and no close to wait for)
                w.kill("daemon stopping")
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
        for i, slot in enumerate(self.slots):
            slot.drop_kv()
            if self.opts.state_dir is not None:
                slot_socket_path(self.opts.state_dir, i).unlink(missing_ok=True)
        if self.zygotes:
            self.zygotes.stop()
        self._publish()
        self._sel.close()
        if self.adoption is not None:
            self.adoption.listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        return True

    # ---- /status ------------------------------------------------------------------------------

    def _publish(self) -> None:
        now = time.monotonic()
        workers = [info.status(slot, self.holder(slot), now) | {"dp_rank": self.dp_rank(slot), "front": self.front_slots[
                   slot].front_status(self.front_of(slot), now)} for slot, info in enumerate(self.slots)]
        spares = [w.spare_status(now) for w in self.idle_spares()]
        with self._published:
            z = self.zygotes
            self._snapshot = {"workers": workers, "spares": spares, "zygote_restarts": z.restarts if z else 0,
                              "zygote_error": z.error if z else None, "cores_left": cores_left(self)}
            self._published.notify_all()
