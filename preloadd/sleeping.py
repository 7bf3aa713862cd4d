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

At level 1 on a GPU a warm spare is kept instead, on the device, as vLLM's level 1 keeps
its processes: told to, it lets go of the daemon's weights, their addresses kept, holding
its CUDA context and graphs (worker/link.py's "release"). At the wake, once the weights are back, it maps
the new arena where the old one was ("remap") and the refill gives it the slot as after a
core's death: a core ready without a fork, an attach, a first step or the largest graph's
capture. (The driver's checkpoint of such a spare, ipc/cuda_checkpoint.py, freed its context
too, but restored a V2-Lite spare in 2.4 s on an H100, where a fork serves 1.4 s after the
weights are back: docs/operating.md.) A spare that cannot be kept (it maps another daemon's
draft model, or does not let go in time) is killed, as without this.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING

from preload.preloadd.rolling import cancel_restarts
from preload.preloadd.workers import Worker

if TYPE_CHECKING:  # the supervisor drives this; only its type is needed here
    from preload.preloadd.supervisor import Supervisor

log = logging.getLogger("preload.daemon")


KEPT = ("releasing", "released")  # a kept spare's states while asleep (then "standby" again, once remapped)


def fall_asleep(sup: Supervisor, level: int, keep_spares: bool = False) -> None:
    cancel_restarts(sup)  # (a restart has nothing left to replace)
    sup.asleep = level
    for w in list(sup.workers.values()):
        if w.role == "front":
            tell(w, sleep_message(level))
        elif keep_spares and w.slot is None and w.state == "standby" and not w.retiring:
            w.state = "releasing"
            tell(w, {"release": True})
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
    """Engine cores and spares not reaped yet, but for spares kept (asleep: 0 once every
    other one has gone)."""
    return sum(w.role != "front" and (w.state not in KEPT or w.retiring) for w in sup.workers.values())


def on_kept_event(sup: Supervisor, w: Worker, event: str, msg: dict) -> None:
    """What a kept spare says (worker/link.py): it let go of the weights, mapped the new
    ones, or cannot be kept (then it goes, as an unkept one does)."""
    if event == "released" and w.state == "releasing":
        w.state = "released"
    elif event == "remapped" and w.state == "released":
        w.state = "standby"
        log.info("spare (pid %d) kept through the sleep: its weights mapped again", w.pid)
    elif event == "kept_failed":
        let_kept_go(sup, w.pid, f"not kept through the sleep: {msg.get('why')}")


def let_kept_go(sup: Supervisor, pid: int, why: str) -> None:
    w = sup.workers.get(pid)
    if w is not None and not w.retiring:
        log.warning("spare (pid %d) %s", pid, why)
        w.retiring = True
        w.kill(why)


def remap_kept(sup: Supervisor, arenas: dict[int, tuple[dict, list[int]]]) -> None:
    """Each kept spare told the new arena of its data-parallel rank ({rank: (the remap
    message, its fds)}), to map where the last one was."""
    for w in list(sup.workers.values()):
        if w.state == "released" and not w.retiring:
            msg, fds = arenas[w.dp_rank]
            try:
                socket.send_fds(w.link, [json.dumps(msg).encode()], fds)
            except OSError:
                pass  # it died meanwhile: its pidfd says so


def remap_message(manifest) -> dict:
    """What a kept spare is told at the wake (worker/link.py's "remap"), beside the arena's fd."""
    return {"remap": True, "arena": manifest.arena.to_wire(), "fingerprint": manifest.fingerprint}


def sleep_request(sup: Supervisor, op: str, arg) -> None:
    """A sleep, a wake, or an ask of the kept spares (Supervisor.kept: "remap" with the
    new arenas, "let_go" of one of them), in the supervisor's thread."""
    if op == "sleep":
        fall_asleep(sup, *arg)
    elif op == "wake":
        wake(sup)
    elif arg[0] == "remap":
        remap_kept(sup, arg[1])
    elif arg[0] == "let_go":
        let_kept_go(sup, *arg[1])


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
CORES_GONE_TIMEOUT = 30.0  # seconds for every core killed at sleep to be reaped (and every kept spare to let go)
REMAP_TIMEOUT = 10.0  # seconds for a kept spare to map the weights again at the wake
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
    slot gets a core, ready when all are: first the spares kept through a level-1 sleep
    (above), once they map the weights again."""

    def __init__(self, daemon):
        self.d = daemon
        self.level: int | None = None  # while sleeping, falling asleep or waking
        self.since: float | None = None  # when the sleep was asked for (wall clock)
        self.asleep = False  # every core gone (and at level 2 the weights): the sleep is done
        self.stashes: list = []  # level 1 on a GPU: (host copy, manifest) of each copy of the weights
        self.error: str | None = None  # what went wrong in the last sleep or wake (the weights stayed, or are not back)
        self.failed_wakes = 0  # wakes that left it asleep (`preload wake` says so, and can try again)
        self.kept: list[int] = []  # the spares kept through this sleep (pids)
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
                "spares_kept": len(self.kept), "error": self.error, "failed_wakes": self.failed_wakes}

    def _sleep(self, level: int) -> None:
        d = self.d
        d.state, self.level, self.since, self.error, self.failed_wakes = "sleeping", level, time.time(), None, 0
        keep = level == 1 and self._can_keep_spares()
        d.supervisor.sleep(level, keep_spares=keep)
        deadline = time.monotonic() + CORES_GONE_TIMEOUT
        while self._letting_go_of_cores() and time.monotonic() < deadline:
            time.sleep(0.02)
        if keep:
            self._count_kept()
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
            return  # (the kept spares stay kept, for the next wake)
        d.state = "waking"  # (a load said "loading" meanwhile)
        self._remap_kept()
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

    def _can_keep_spares(self) -> bool:
        """Spares are kept through a level-1 sleep on a GPU, where a spare maps nothing but
        these weights (no tensor-parallel group; one that maps another daemon's draft model
        says it cannot be kept)."""
        return self.d.r.device != "cpu" and self.d.opts.worker.engine.tensor_parallel_size == 1

    def _letting_go_of_cores(self) -> bool:
        s = self.d.supervisor.status()
        return bool(s.get("cores_left", 1)) or any(x["state"] == "releasing" for x in s["spares"])

    def _count_kept(self) -> None:
        """The spares that let go of the weights are kept; one that did not in time is killed."""
        sup = self.d.supervisor
        for x in sup.status()["spares"]:
            if x["state"] == "releasing":
                sup.kept("let_go", (x["pid"], "not kept through the sleep: it did not let go of the weights in time"))
        self.kept = [x["pid"] for x in sup.status()["spares"] if x["state"] == "released"]
        log.info("sleep level 1: %d spare(s) kept on the device, the weights let go", len(self.kept))

    def _remap_kept(self) -> None:
        """Each kept spare told the new arena of its rank, and waited for until it mapped it
        where the last one was (0.02-0.03 s for V2-Lite); one that does not is killed."""
        if not self.kept:
            return
        sup, t0 = self.d.supervisor, time.monotonic()
        sup.kept("remap", {rank: (remap_message(c.manifest), c.arena.fds()) for rank, c in enumerate(self.d.copies)})
        deadline = time.monotonic() + REMAP_TIMEOUT
        while [x for x in sup.status()["spares"] if x["state"] in KEPT] and time.monotonic() < deadline:
            time.sleep(0.002)
        waiting = [x["pid"] for x in sup.status()["spares"] if x["state"] in KEPT]
        for pid in waiting:
            sup.kept("let_go", (pid, "not kept through the sleep: it did not map the weights again in time"))
        log.info("wake: %d kept spare(s) mapped the weights again in %.3f s", len(self.kept) - len(waiting),
                 time.monotonic() - t0)
        self.kept = []

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
