"""Sleep and wake (`preload sleep`, `preload wake`; the daemon's POST /sleep, POST
/wake_up, GET /is_sleeping, as vLLM names them): the supervisor's part, then the daemon's.

Asleep, a daemon runs no engine core: every slot's core and every spare is killed, the
slots' KV memory let go, and no slot or spare is filled again, so that the device (or, on
a CPU, the host's memory) holds the weights alone (level 1), or nothing of ours (level 2:
the daemon lets the weights go too, preloadd/daemon.py). The fronts stay: they hold the
clients and their requests, told on their links that their slot sleeps (worker/front.py:
/health says so, requests wait), and hand the requests to the first core after the wake,
which the refill forks as at a start. A core killed for sleep is replaced as a restart's
is (its takeover "restart"): nothing counts as a failure, nothing as a restart.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from preload.preloadd.rolling import cancel_restarts
from preload.preloadd.workers import Worker

if TYPE_CHECKING:  # the supervisor drives this; only its type is needed here
    from preload.preloadd.supervisor import Supervisor

log = logging.getLogger("preload.daemon")


def fall_asleep(sup: Supervisor, level: int) -> None:
    cancel_restarts(sup)  # (a restart has nothing left to replace)
    sup.asleep = level
    for w in list(sup.workers.values()):
        if w.role == "front":
            tell(w, sleep_message(level))
        else:  # (a slot's core, an old one still draining from a restart, or a spare: each holds memory)
            if w.slot is not None and w.holds(w.slot):
                sup.slots[w.slot].replaced("sleep", w)
            w.retiring = True
            w.kill("sleep")  # (a spare too: one told by EOF exits only once warm, and then slowly: on an H100
            # with V2-Lite it still ran 5 s later, when its silence had it killed as hung)
    for info in sup.slots:
        info.drop_kv()
    log.info("asleep (level %d): every engine core and spare let go", level)


def wake(sup: Supervisor) -> None:
    """Fill every slot again (the refill, from the next turn on), and tell the fronts."""
    sup.asleep = None
    for w in sup.workers.values():
        if w.role == "front":
            tell(w, sleep_message(None))
    log.info("waking: every slot gets a new engine core")


def cores_left(sup: Supervisor) -> int:
    """Engine cores and spares not reaped yet (asleep: 0 once every one has gone)."""
    return sum(w.role != "front" for w in sup.workers.values())


def sleep_message(level: int | None) -> dict:
    """What a front is told on its link (worker/link.py): asleep at `level`, or awake."""
    return {"sleeping": True, "level": level} if level else {"sleeping": False}


def tell(front: Worker, msg: dict) -> None:
    try:
        front.link.send(json.dumps(msg).encode())
    except OSError:
        pass  # it died meanwhile: its successor is told as it starts (Supervisor.adopt)


# ---- the daemon's part: its state and its weights -------------------------------------------

LEVELS = (1, 2)
CORES_GONE_TIMEOUT = 30.0  # seconds for every core killed at sleep to be reaped
HOST_SHARE = 0.9  # of the host memory free that a level-1 sleep may take for the weights (the rest: everyone else)


class Sleeper:
    """The daemon's sleep and wake, run by its main thread between its other chores
    (Daemon.run's loop: `turn`); asked from the control thread or the health port (`ask`).

    ready -> sleeping: the state says so at once (/health 503); the supervisor lets every
    core go; once every one is reaped, level 2 lets the weights go too (the keeper's hold
    and the arena: the memory is freed); level 1 on a GPU first copies each copy of the
    weights to host memory (ipc/host_stash.py), then lets them go as level 2 does (on a CPU
    they stay where they are: host memory already). sleeping -> waking -> ready: the weights
    put back from host memory (level 1) or loaded again as a start does (level 2), then every
    slot gets a core, ready when all are."""

    def __init__(self, daemon):
        self.d = daemon
        self.level: int | None = None  # while sleeping, falling asleep or waking
        self.since: float | None = None  # when the sleep was asked for (wall clock)
        self.asleep = False  # every core gone (and at level 2 the weights): the sleep is done
        self.stashes: list = []  # level 1 on a GPU: (host copy, manifest) of each copy of the weights
        self.error: str | None = None  # what went wrong in the last sleep or wake (the weights stayed, or are not back)
        self.failed_wakes = 0  # wakes that left it asleep (`preload wake` says so, and can try again)
        self._letting_go: threading.Thread | None = None  # the last wake's host copies, freed meanwhile
        self._asked: queue.SimpleQueue = queue.SimpleQueue()
        self.poke = threading.Event()  # the main thread's wake-up

    def ask(self, op: str, level: int | None = None) -> dict:
        """A sleep (level 1 or 2) or a wake, queued for the main thread; what to reply."""
        d = self.d
        if d.supervisor is None:
            return {"ok": False, "error": "this daemon runs no workers (start it with --workers N): nothing sleeps"}
        if op == "sleep":
            if level not in LEVELS:
                return {"ok": False, "error": f"sleep level {level!r}: 1 (keep the weights) or 2 (drop them)"}
            kinds = {copy.arena.info().transport for copy in d.copies}
            if level == 1 and d.r.device != "cpu" and kinds - {"cuda-vmm"}:
                return {"ok": False, "error": f"sleep level 1 moves cuda-vmm arenas to host memory; these are {kinds}:"
                        " level 2 frees the device (the weights are read again at wake)"}
        self._asked.put((op, level))
        self.poke.set()
        return {}

    def turn(self) -> None:
        while not self._asked.empty():
            op, level = self._asked.get()
            if op == "sleep" and self.d.state == "ready":
                self._sleep(level)
            elif op == "wake" and self.d.state == "sleeping":
                self._wake()

    def status(self) -> dict | None:
        if self.level is None:
            return None
        on_host = self.d.r.device == "cpu"
        held = [copy.arena.size for copy in self.d.copies] if on_host else [s.info.size for s, _ in self.stashes]
        return {"level": self.level, "since": self.since, "asleep": self.asleep, "host_bytes": sum(held),
                "error": self.error, "failed_wakes": self.failed_wakes}

    def _sleep(self, level: int) -> None:
        d = self.d
        d.state, self.level, self.since, self.error, self.failed_wakes = "sleeping", level, time.time(), None, 0
        d.supervisor.sleep(level)
        deadline = time.monotonic() + CORES_GONE_TIMEOUT
        while d.supervisor.status().get("cores_left", 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        if level == 1 and d.r.device != "cpu":
            self._to_host()
        if level == 2 or self.stashes:
            d.let_weights_go()
        self.asleep = True
        log.info("asleep, level %d", level)

    def _wake(self) -> None:
        d = self.d
        d.state, self.asleep, self.error = "waking", False, None
        t0 = time.monotonic()
        d.spawn_keeper()
        try:
            if self.stashes:
                self._from_host()
            elif not d.copies:
                d.load_again()
        except Exception as e:  # noqa: BLE001 (the device taken meanwhile, the files gone: asleep still, not dead)
            log.error("wake: the weights are not back (%s); still asleep: `preload wake` tries again", e, exc_info=True)
            d.state, self.asleep, self.error = "sleeping", True, f"the wake failed: {e}"
            self.failed_wakes += 1
            return
        d.state = "waking"  # (a load said "loading" meanwhile)
        d.supervisor.sleep(None)
        deadline = time.monotonic() + d.opts.worker_start_timeout
        while not all(w["state"] == "ready" for w in d.supervisor.status()["workers"]):
            if time.monotonic() > deadline:
                log.error("wake: not every slot is ready after %.0f s; the supervisor goes on filling them",
                          d.opts.worker_start_timeout)
                break
            time.sleep(0.02)
        d.state, self.level, self.since = "ready", None, None
        log.info("awake in %.2f s", time.monotonic() - t0)

    def _to_host(self) -> None:
        """Each copy of the weights copied to host memory, or none (then they stay on the
        device: said, and the sleep frees the cores' memory alone)."""
        from preload.ipc import host_stash

        if self._letting_go is not None:
            self._letting_go.join()  # (the last wake's host memory, before this sleep counts what is free)
        t0, need, room = time.monotonic(), sum(copy.arena.size for copy in self.d.copies), host_stash.host_room()
        try:
            if need > room * HOST_SHARE:
                raise MemoryError(f"{need / 2**30:.1f} GiB of weights, {room / 2**30:.1f} GiB of host memory free")
            for copy in self.d.copies:
                self.stashes.append((host_stash.stash(copy.arena.info(), copy.arena.fds()[0]), copy.manifest))
        except Exception as e:  # noqa: BLE001 (host memory short, a driver error: the weights stay where they are)
            log.error("sleep level 1: the weights could not be copied to host memory (%s); they stay on the device", e)
            self.error = f"the weights could not be copied to host memory ({e}): they stay on the device"
            self._drop_stashes()
            return
        log.info("sleep level 1: %d bytes of weights copied to host memory in %.2f s (%s)",
                 sum(s.info.size for s, _ in self.stashes), time.monotonic() - t0,
                 "; ".join(s.unpinned or "page-locked" for s, _ in self.stashes))

    def _from_host(self) -> None:
        """The weights put back on the device from host memory, the same bytes (no load)."""
        from dataclasses import replace

        from preload.ipc import host_stash
        from preload.preloadd.weights import Loaded

        t0, copies = time.monotonic(), []
        try:
            for held, manifest in self.stashes:
                arena = host_stash.restore(held)
                copies.append(Loaded(arena, replace(manifest, arena=arena.info())))
            t1 = time.monotonic()
            self.d.load_again(copies)
        except BaseException:  # (the host copies stay, for the next wake)
            for copy in copies:
                copy.arena.close()
            self.d.copies = []
            raise
        log.info("wake: %d bytes of weights back on the device in %.2f s (copied in %.2f s, the keeper given them in"
                 " %.2f s)", sum(c.arena.size for c in copies), time.monotonic() - t0, t1 - t0, time.monotonic() - t1)
        stashes, self.stashes = self.stashes, []
        self._letting_go = threading.Thread(target=drop, args=(stashes,), name="stash-let-go", daemon=True)
        self._letting_go.start()  # (unpinning and freeing 29 GiB of pages is not the wake's to wait for: on an H100
        # the wake took 5.5 s with it, of which the copy is 0.6 s (scripts/probe_host_stash.py); the log says its share)

    def _drop_stashes(self) -> None:
        drop(self.stashes)
        self.stashes = []


def drop(stashes: list) -> None:
    t0 = time.monotonic()
    for held, _ in stashes:
        held.close()
    log.info("sleep level 1: the host copies of the weights let go in %.2f s", time.monotonic() - t0)
