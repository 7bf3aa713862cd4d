"""Workers a dead daemon left serving, taken over by the next daemon of the state dir.

A supervised worker whose daemon dies keeps serving on the shared API socket and tries,
every few tenths of a second, <state dir>/workers.sock (worker/link.py). A new daemon
listens there. A worker of our uid that claims a slot of this daemon, with the
fingerprint of the weights this daemon holds, while that slot is free, is supervised
again as that slot's worker: its KV cache and its requests carry on. Any other is told
to retire: it drains and exits, and its slot gets a fresh worker. So does a core when this
daemon loaded the weights again instead of taking them back from the keeper (another
--data-parallel-size, a keeper that died): the copy it maps would stay in memory beside ours.

While a live orphan has not called yet (it tries again within REJOIN_INTERVAL), the new
daemon leaves its slot empty, for at most ADOPT_WAIT seconds.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from preload.ipc.protocol import peer_credentials, workers_socket_path

ADOPT_WAIT = 5.0  # seconds a slot whose orphan lives waits for it to call
CLAIM_TIMEOUT = 1.0  # seconds a connected orphan has to say who it is


def left_running(state_dir: Path) -> list[psutil.Process]:
    """Processes of our uid that a daemon of `state_dir` started (workers, spares, its
    zygote, its keeper), found by their titles: `preload <role> --state-dir <dir>`."""
    found = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = " ".join(p.info["cmdline"] or []) + " "
        if (p.pid != os.getpid() and p.info["uids"] and p.info["uids"].real == os.getuid()
                and cmd.startswith("preload ") and f"--state-dir {state_dir} " in cmd):
            found.append(p)
    return found


def orphan_slots(state_dir: Path, role: str = "worker") -> dict[int, int]:
    """{slot: pid} of the serving workers (cores; `role` "front": the fronts) a dead daemon
    of `state_dir` left."""
    slots = {}
    for p in left_running(state_dir):
        m = re.match(rf"preload {role} (\d+) ", " ".join(p.info["cmdline"] or []))
        if m:
            slots[int(m.group(1))] = p.pid
    return slots


class OrphanListener:
    """The socket orphans call (SOCK_SEQPACKET, 0600 in the state dir)."""

    def __init__(self, state_dir: Path):
        self.path = workers_socket_path(state_dir)
        self.path.unlink(missing_ok=True)  # a dead daemon's; we hold the state dir's lock
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(16)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, dict, list[int]] | None:
        """A connected orphan of our uid, what it claims (its pid checked against the
        kernel's word) and the fd of its KV memory (if it sent one); None for anything
        else, which is closed."""
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return None
        fds: list[int] = []
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != os.getuid():
                raise ValueError(f"uid {uid}")  # (before reading anything it sends)
            conn.settimeout(CLAIM_TIMEOUT)
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
            claim = json.loads(data)
            if isinstance(claim, dict) and claim.get("event") == "adopt" and claim.get("pid") == pid:
                return conn, claim, fds
        except (OSError, ValueError):
            pass
        for fd in fds:
            os.close(fd)
        conn.close()
        return None

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


@dataclass
class Adoption:
    """A new daemon's take-over of the orphans: where they call, the weights they must
    serve, and those still expected."""

    listener: OrphanListener
    fingerprint: str
    listen: list  # [host, port] of this daemon's API socket: an orphan must serve that one
    expected: dict[int, int]  # slot -> pid of a live orphan core that has not called yet
    expected_fronts: dict[int, int] = field(default_factory=dict)  # likewise, the fronts
    took_back: bool = True  # the weights are those the orphans map (a keeper's), not loaded again
    until: float = field(default_factory=lambda: time.monotonic() + ADOPT_WAIT)

    def waiting_for(self, slot: int, role: str = "core") -> bool:
        """Whether `slot` should stay without its core (or front) a while: its orphan
        lives and may still call."""
        expected = self.expected_fronts if role == "front" else self.expected
        pid = expected.get(slot)
        if pid is not None and (time.monotonic() > self.until or not psutil.pid_exists(pid)):
            del expected[slot]
            pid = None
        return pid is not None

    def verdict(self, claim: dict, slots: int, vacant: Callable[[int], bool],
                dp_rank: Callable[[int], int] = lambda slot: 0) -> str | None:
        """None: take the orphan on as its slot's core or front (`vacant`: whether the slot
        has none; `dp_rank`: whose copy of the weights the slot's core maps); else why it
        must retire."""
        self.expected = {s: p for s, p in self.expected.items() if p != claim.get("pid")}
        self.expected_fronts = {s: p for s, p in self.expected_fronts.items() if p != claim.get("pid")}
        slot = claim.get("slot")
        if claim.get("fingerprint") != self.fingerprint:
            return "it serves other weights than this daemon holds"
        if claim.get("listen") != self.listen:  # (started on another --host or --port: clients come there now)
            return f"it serves {claim.get('listen')}, this daemon's API is {self.listen}"
        if not isinstance(slot, int) or not 0 <= slot < slots:
            return f"slot {slot!r} is not one of this daemon's {slots}"
        if claim.get("role") != "front" and not self.took_back:  # (its mapping would keep a second copy alive)
            return "it maps the weights the last daemon held; this one loaded them again"
        if claim.get("dp_rank", 0) != dp_rank(slot):  # (a core maps that rank's copy; a front names it in /metrics)
            return f"it serves data-parallel rank {claim.get('dp_rank', 0)}, slot {slot} is rank {dp_rank(slot)}'s"
        if not vacant(slot):
            return f"slot {slot} has a {'front' if claim.get('role') == 'front' else 'worker'} already"
        return None
