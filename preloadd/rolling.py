"""A rolling restart (`preload restart` without --now) as a state machine that the
supervisor's loop advances once a turn: every slot in order, one at a time. (And
`restart --now`, `restart_now`: every core at once.)

For each slot: a replacement core is forked and warms up while the old one serves (the next
slots' replacements warm beside it, as many as the spares retired at the start left room
for: a core's start, 1.2-1.3 s on an H100, was most of each slot's turn). Then,
when the device has room for both KV caches, the replacement takes the slot first (go,
ready): its hello makes the slot's front hand it every request in flight (worker/front.py),
so the old core, retired by the front and SIGTERMed here, has nothing left to drain.
Otherwise the old core is killed first (its front holds its requests), then the replacement
takes the slot and the requests. The next slot starts at once. If the replacement fails
before it takes over, the old worker keeps serving. The fronts are not restarted: they
hold the clients. Spares are retired at the start (they run the code of before); the
supervisor's refill warms new ones.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from preload.preloadd.workers import Worker

if TYPE_CHECKING:  # the supervisor drives this machine; only its type is needed here
    from preload.preloadd.supervisor import Supervisor

log = logging.getLogger("preload.daemon")


class RollingRestart:
    def __init__(self, sup: Supervisor):
        retired = [0] * sup.dp_ranks
        for w in sup.idle_spares():
            sup.retire_spare(w)
            retired[w.dp_rank] += 1
        # Replacements that warm at once on a rank: the one a restart always had room for, and one
        # in each retired spare's room (a spare keeps what a core needs beside its KV cache).
        self.window = [1 + n for n in retired]
        self.todo = list(range(len(sup.slots)))
        self.old: Worker | None = None
        self.fresh: Worker | None = None
        self.ahead: dict[int, Worker] = {}  # slot -> its replacement, forked before the slot's turn
        self.phase = "next"  # next -> warming -> taking_over | draining_first -> next ...
        self.drain_timeout = sup.opts.worker.drain_timeout

    def advance(self, sup: Supervisor) -> bool:
        """Move on as far as the workers allow; True once every slot is done."""
        while True:
            before = self.phase
            getattr(self, f"_{self.phase}")(sup)
            if self.phase == "done":
                return True
            if self.phase == before:
                return False  # waiting for a worker

    def cancel(self, sup: Supervisor) -> None:
        """Given up (a restart --now came): the replacements that have not taken over go."""
        for w in [self.fresh, *self.ahead.values()]:
            self._drop(sup, w, "restart cancelled")
        self.ahead.clear()

    def _drop(self, sup: Supervisor, w: Worker | None, why: str) -> None:
        if w is not None and w.relief and w.pid in sup.workers:
            w.retiring = True
            w.kill(why)

    def _alive(self, sup: Supervisor, w: Worker | None) -> bool:
        return w is not None and w.pid in sup.workers

    def _next(self, sup: Supervisor) -> None:
        if not sup.zygote_current():
            return  # the code changed: a new zygote is importing it
        while self.todo:
            slot = self.todo.pop(0)
            self.old, early = sup.holder(slot), self.ahead.pop(slot, None)
            if self.old is None:
                self._drop(sup, early, "rolling restart: its slot is vacant")
                continue  # vacant: the refill fills it, with the code of now
            self.fresh = early if self._alive(sup, early) else self._fork(sup, slot)
            self._fork_ahead(sup)
            self.phase = "warming"
            return
        self.phase = "done"

    def _fork(self, sup: Supervisor, slot: int) -> Worker:
        w = sup.spawn(slot)
        w.relief = True
        return w

    def _fork_ahead(self, sup: Supervisor) -> None:
        """The next slots' replacements, forked now where their rank's window has room."""
        for slot in self.todo:
            rank = sup.dp_rank(slot)
            warming = sum(w.dp_rank == rank for w in [self.fresh, *self.ahead.values()])
            if slot not in self.ahead and warming < self.window[rank] and sup.holder(slot) is not None:
                self.ahead[slot] = self._fork(sup, slot)

    def _warming(self, sup: Supervisor) -> None:
        old, fresh, slot = self.old, self.fresh, self.fresh.slot
        if not self._alive(sup, fresh):
            log.error("replacement for worker %d did not warm up; keeping the old one", slot)
            self.phase = "next"
        elif not self._alive(sup, old):  # the old one died meanwhile: the replacement takes over now
            self._hand_over(sup, drain=False)
            sup.go(fresh)
            self.phase = "next"
        elif fresh.state == "standby":
            if sup.room_for(old.kv_cache_bytes, fresh.dp_rank):
                sup.go(fresh)
                self.phase = "taking_over"
            else:  # (its front holds the requests meanwhile, and hands them to the replacement: nothing to drain)
                log.info("no room for a second KV cache: worker %d goes before its replacement takes over", slot)
                self._hand_over(sup, drain=False)
                old.kill("rolling restart: no room for two KV caches; its front hands its requests on")
                self.phase = "draining_first"

    def _taking_over(self, sup: Supervisor) -> None:
        if not self._alive(sup, self.fresh):
            log.error("replacement for worker %d did not become ready; keeping the old one", self.fresh.slot)
            self.phase = "next"
        elif self.fresh.state == "ready" or not self._alive(sup, self.old):
            self._hand_over(sup, drain=True)
            self.phase = "next"

    def _draining_first(self, sup: Supervisor) -> None:
        if not self._alive(sup, self.old):
            if self._alive(sup, self.fresh):
                sup.go(self.fresh)
            self.phase = "next"  # from here the replacement is an ordinary worker of its slot

    def _hand_over(self, sup: Supervisor, drain: bool) -> None:
        """The replacement holds the slot from now on; the old worker drains. (If the old
        one died meanwhile, its exit is already on the slot's record.)"""
        old, fresh = self.old, self.fresh
        fresh.relief = False
        info = sup.slots[fresh.slot]
        if self._alive(sup, old):
            info.restarts += 1
            info.replaced("restart", old)
            if drain:
                sup.drain(old, self.drain_timeout)
                info.replacement["old_signalled"] = old.stamps["signalled"]
            else:
                old.retiring = True
        info.replacement["via"], info.successor = "fork", fresh
        log.info("worker %d: pid %d takes over from pid %d", fresh.slot, fresh.pid, old.pid)


def cancel_restarts(sup: Supervisor) -> None:
    """The rolling restart under way, and one queued after it, given up (a restart --now or
    a sleep replaces, or lets go, every core at once)."""
    if sup.rolling is not None:
        sup.rolling.cancel(sup)
        sup.rolling = None
    sup._restart_queued = False


def restart_now(sup: Supervisor) -> None:
    """`restart --now`: every core killed at once (the fronts stay: they hand the requests to
    the new cores), every spare retired; the refill forks new ones."""
    cancel_restarts(sup)
    for w in list(sup.workers.values()):
        if w.role == "front":
            continue  # (the fronts stay: they hand the requests to the new cores)
        if w.slot is None and not w.retiring:
            sup.retire_spare(w)
        elif w.slot is not None and w.holds(w.slot):
            w.retiring = True
            info = sup.slots[w.slot]
            info.restarts += 1
            w.kill("restart --now")
            info.replaced("restart --now", w)
