"""What the supervisor knows of each worker process and each slot, and how exits read.

Only the supervisor's thread changes these records; /status sees copies it publishes.
Times are monotonic for deadlines; `stamps` holds wall-clock times (time.time()) of a
worker's stages, published so that an operator or a benchmark can see where a restart
went without reading logs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

PR_SET_CHILD_SUBREAPER = 36
log = logging.getLogger("preload.daemon")

STABLE_AFTER = 5.0  # a worker that lived this long was not crash-looping
MAX_BACKOFF = 30.0


@dataclass(eq=False)
class Worker:
    pid: int
    link: socket.socket  # the daemon's end of the worker's link (worker/link.py)
    pidfd: int  # readable once the process has exited
    slot: int | None  # None: a spare
    proc: subprocess.Popen | None = None  # a fresh interpreter (no zygote) is reaped through its Popen
    role: str = "core"  # a slot's engine core, or its front (HTTP: worker/serve.py); spares are cores
    dp_rank: int = 0  # whose copy of the weights it maps (--data-parallel-size)
    # Before it is told its slot: warming -> standby. After: starting -> ready -> draining.
    state: str = "warming"
    told: bool = False  # given its slot
    retiring: bool = False  # replaced on purpose: its exit is not a failure
    relief: bool = False  # a rolling restart's replacement that does not hold its slot yet
    adopted: bool = False  # left by an earlier daemon: not our child, its exit status unknown
    since: float = field(default_factory=time.monotonic)  # forked, or told its slot
    heard: float | None = None  # its last message
    steps: int = 0  # engine steps, from its last beat
    busy: bool = False  # its engine had work at its last beat
    progress_at: float = field(default_factory=time.monotonic)  # last beat with a new step, or idle
    kv_cache_bytes: int = 0
    deadline: float | None = None  # draining: killed if still alive then
    kill_reason: str | None = None  # why the supervisor killed it
    stamps: dict[str, float] = field(default_factory=lambda: {"forked": time.time()})

    @classmethod
    def orphan(cls, claim: dict, conn: socket.socket, pidfd: int, retire: str | None, drain_timeout: float) -> Worker:
        """A worker a dead daemon left, as its `claim` says (orphans.py): supervised again,
        or, with a reason to `retire`, draining (it was told so)."""
        front = claim.get("role") == "front"
        w = cls(claim["pid"], conn, pidfd, claim["slot"] if retire is None or front else None, adopted=True, told=True,
                role="front" if front else "core", dp_rank=claim.get("dp_rank", 0))
        w.stamps["adopted"] = time.time()
        if retire is None:
            w.state, w.heard = "ready", time.monotonic()
            w.kv_cache_bytes = int(claim.get("kv_cache_bytes") or 0)
            log.info("%s (pid %d), left by the last daemon, is supervised again", w.name, w.pid)
        else:
            w.retiring, w.state = True, "draining"
            w.deadline = time.monotonic() + drain_timeout + 5
            log.warning("pid %d, left by the last daemon, retires: %s", w.pid, retire)
        return w

    @property
    def name(self) -> str:
        if self.role == "front":
            return f"front {self.slot}"
        return "spare" if self.slot is None else f"worker {self.slot}"

    def holds(self, slot: int) -> bool:
        """Whether this worker is the core serving (or about to serve) `slot`."""
        return self.role == "core" and self.slot == slot and not self.retiring and not self.relief

    def fronts(self, slot: int) -> bool:
        """Whether this worker is the front of `slot`."""
        return self.role == "front" and self.slot == slot and not self.retiring

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def hung(self, opts, now: float) -> str | None:
        """Why it must be killed as hung (`opts`: the daemon's DaemonOptions), or None: still
        draining past its deadline, not warm or ready in time, no heartbeat, or an engine
        with work and no step."""
        if self.state == "draining":
            return f"still draining {opts.worker.drain_timeout + 5:.0f} s after SIGTERM" if now > self.deadline else None
        if self.state in ("warming", "starting") and now - self.since > opts.worker_start_timeout:
            return f"hung: not {'warm' if self.state == 'warming' else 'ready'} within {opts.worker_start_timeout:g} s"
        if self.heard is not None and now - self.heard > opts.worker_timeout:
            return f"hung: no heartbeat for {now - self.heard:.1f} s"
        if self.busy and now - self.progress_at > opts.engine_step_timeout:
            return f"hung: its engine had work and made no step for {now - self.progress_at:.1f} s"
        return None

    def excuse(self, seconds: float) -> None:
        """Move its deadlines on by `seconds` the supervisor did not watch (its own stall)."""
        if self.heard is not None:
            self.heard += seconds
        if self.deadline is not None:
            self.deadline += seconds
        self.since += seconds
        self.progress_at += seconds

    def kill(self, reason: str) -> None:
        if self.kill_reason is None:
            self.kill_reason, self.stamps["killed"] = reason, time.time()
        self.signal(signal.SIGKILL)

    def spare_status(self, now: float) -> dict:
        return {"pid": self.pid, "state": self.state, "uptime_s": round(now - self.since, 3), "dp_rank": self.dp_rank,
                "forked": self.stamps["forked"], "warm": self.stamps.get("warm")}

    def close(self) -> None:
        self.link.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass
class Slot:
    restarts: int = 0
    failures: int = 0  # consecutive early exits (0 once a worker is ready: `ready`)
    streak: int = 0  # the early exits before the worker that is ready now
    last_exit: str | None = None
    next_start: float = 0.0  # backoff: not before this time
    replacement: dict = field(default_factory=dict)  # stage stamps of its latest replacement
    successor: Worker | None = None  # the worker that replacement brought in
    # The KV memory its workers keep (ipc/kv_memory.py): an fd, the engine's budget, its
    # size. Held here so that the next worker of the slot maps it instead of allocating.
    kv: tuple[int, int, int] | None = None

    def keep_kv(self, fds: list[int], msg: dict) -> None:
        """Hold the KV memory a worker of this slot sent (with `msg`'s sizes), instead of
        what was held before (a worker that could not use it made its own)."""
        if not fds:
            return
        try:
            kv = (fds[0], int(msg["kv_cache_bytes"]), int(msg["kv_memory_bytes"]))
        except (KeyError, TypeError, ValueError):
            close_fds(fds)
            raise
        close_fds(fds[1:])
        self.drop_kv()
        self.kv = kv

    def drop_kv(self) -> None:
        if self.kv is not None:
            os.close(self.kv[0])
            self.kv = None

    def vacancy(self) -> str:
        """The state of this slot while no worker holds it."""
        if self.failures > 1:
            return "backoff"
        return "restarting" if self.last_exit else "starting"

    def ready(self) -> None:
        """A worker of this slot is ready: no crash loop shows while it serves."""
        self.streak, self.failures = self.failures, 0

    def record_exit(self, worker: Worker, reason: str, own: bool = False) -> float:
        """Book a worker's unplanned exit; returns the delay before the next start. Early
        exits in a row back off: one before the worker was ready, or one of its own (`own`:
        an exit status, not a signal) soon after: a worker that fails in its first idle
        work each time loops as surely as one that never starts (a float32 model's spare
        did, on a GPU, at 0.6 s a turn), while a ready one killed is no sign of a loop."""
        self.last_exit, self.restarts = reason, self.restarts + 1
        young = time.monotonic() - worker.since < STABLE_AFTER
        if young and worker.state not in ("ready", "standby"):
            self.failures += 1
        else:
            self.failures = self.streak + 1 if young and own else 0
        self.streak = 0
        delay = min(0.1 * 2 ** (self.failures - 1), MAX_BACKOFF) if self.failures > 1 else 0.0
        self.next_start = time.monotonic() + delay
        return delay

    def replaced(self, cause: str, old: Worker | None, **stamps) -> None:
        """Start the record of a replacement (its successor is added when one is chosen)."""
        self.replacement = {"cause": cause, "old_pid": old and old.pid, "killed": old and old.stamps.get("killed"),
                            **stamps}
        self.successor = None

    def status(self, slot: int, w: Worker | None, now: float) -> dict:
        """What /status shows of this slot and the worker holding it (if any)."""
        return {
            "slot": slot,
            "pid": w and w.pid,
            "state": w.state if w else self.vacancy(),
            "uptime_s": round(now - w.since, 3) if w else 0.0,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "consecutive_failures": self.failures,
            "kv_cache_bytes": w.kv_cache_bytes if w else 0,
            "last_replacement": self.published_replacement(),
        }

    def front_status(self, front: Worker | None, now: float) -> dict:
        """What /status shows of a slot's front (this record: its fronts' restarts)."""
        return {"pid": front and front.pid, "state": front.state if front else self.vacancy(),
                "uptime_s": round(now - front.since, 3) if front else 0.0, "restarts": self.restarts,
                "last_exit": self.last_exit}

    def published_replacement(self) -> dict | None:
        if not self.replacement:
            return None
        out = dict(self.replacement)
        s = self.successor
        if s is not None:
            out |= {"new_pid": s.pid, "forked": s.stamps.get("forked"), "slot_given": s.stamps.get("slot_given"),
                    "ready": s.stamps.get("ready")}
        return out


def become_subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def describe_exit(returncode: int) -> str:
    """A process's end as `os.waitstatus_to_exitcode` or Popen give it (negative: a signal)."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def reap(worker: Worker, block: bool = False) -> int | None:
    """The worker's exit code once it has exited (None if it has not); reaps it."""
    if worker.proc is not None:
        return worker.proc.wait() if block else worker.proc.poll()
    if worker.adopted:  # not our child: its pidfd says whether it has exited, not how
        return 0 if select.select([worker.pidfd], [], [], None if block else 0)[0] else None
    try:
        pid, status = os.waitpid(worker.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return 0  # reaped already (cannot happen to a worker we watch; never hang on it)
    return os.waitstatus_to_exitcode(status) if pid else None


def reap_orphans(known: set[int]) -> list[tuple[int, int]]:
    """Reap exited children that are none of ours to watch (a worker's own children,
    orphaned and adopted by us as the subreaper). Known pids are only peeked at
    (WNOWAIT): their watchers reap them, the zygote through its Popen, so that its exit
    status is its own."""
    reaped = []
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in known:
            return reaped
        _, status = os.waitpid(info.si_pid, 0)
        reaped.append((info.si_pid, os.waitstatus_to_exitcode(status)))


def unregister(sel: selectors.BaseSelector, fileobj) -> None:
    """Stop watching `fileobj` (a no-op if it is not watched any more)."""
    try:
        sel.unregister(fileobj)
    except (KeyError, ValueError):
        pass


def drain_pipe(fd: int) -> None:
    """Read a non-blocking pipe empty (wake-ups: their number says nothing)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class OwnStalls:
    """Deadlines count the time the daemon watched, not the time it was stalled itself
    (SIGSTOPped, swapped out, a VM paused): its turns come every `tick` at most, so a gap
    longer by over STALL seconds is the judge's stall, and what a worker did meanwhile (its
    beats lie unread in its socket) cannot be held against it: every worker's deadlines
    move on by the stall (issue 36: a daemon stopped for 10-37 s killed every healthy
    worker as hung when it resumed)."""

    STALL = 1.0

    def __init__(self, tick: float):
        self.tick, self.last = tick, time.monotonic()

    def excuse(self, workers) -> None:
        """Called once a turn."""
        now = time.monotonic()
        stalled = now - self.last - self.tick
        self.last = now
        if stalled > self.STALL:
            log.warning("the daemon itself was stalled for %.1f s: its workers' deadlines move on as much", stalled)
            for w in workers:
                w.excuse(stalled)
