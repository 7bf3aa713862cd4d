"""New connections go to the least loaded front, not only where the kernel's accept order
sends them.

Every front accepts on the daemon's one API socket. Left to the kernel, a new connection
goes to whichever front calls accept() first, which is often the same one: an idle event
loop answers first even when its engine core is the busiest (measured on the CPU machine:
four requests in a row, all to one of two fronts). So each front writes its requests in
flight (its open connections: an LLM client keeps one per request stream) to its cell of a
small shared file in the state dir (`load.board`: the count and when it was written, a
slot per cell), and its listening socket (GatedSocket) declines an
accept while a live peer has fewer: the connection stays in the backlog for that peer,
whose own accept takes it within a loop turn. A front defers at most DEFER seconds per
episode, then accepts anyway (a peer whose loop is stuck, or a stale cell, cannot
strand a client), and a cell not written for STALE seconds (a dead front) does not count.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

BOARD = "load.board"
CELL = struct.Struct("<qd")  # requests in flight, time.time() when written
# (The wall clock: the one every front reads alike. Fronts forked from a zygote CRIU restored
# (preloadd/snapshot.py) run in the time namespace CRIU restores into, whose CLOCK_MONOTONIC
# lags the host's by the time since the dump: monotonic stamps of fronts of two starts, or of a
# restored zygote's and a renewed one's, would read as stale or ahead to each other.)
CELLS = 1024  # slots at most: --workers (64) x --data-parallel-size (16)
STALE = 2.0  # seconds: a cell older than this is a dead (or stopped) front's
DEFER = 0.02  # seconds a front leaves a waiting connection to less loaded peers
PUBLISH = 0.1  # seconds between a front's writes while its load stands still (its cell stays fresh)


class LoadBoard:
    """The shared file, mapped; this front's cell is `slot`'s."""

    def __init__(self, state_dir: str | os.PathLike, slot: int):
        if not 0 <= slot < CELLS:
            raise ValueError(f"slot {slot}: the load board has {CELLS} cells")
        fd = os.open(Path(state_dir, BOARD), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < CELLS * CELL.size:
                os.ftruncate(fd, CELLS * CELL.size)  # (zeros: every cell stale)
            self._map = mmap.mmap(fd, CELLS * CELL.size)
        finally:
            os.close(fd)
        self.slot = slot
        self._written = (-1, 0.0)

    def publish(self, load: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if load != self._written[0] or not 0 <= now - self._written[1] < PUBLISH:
            CELL.pack_into(self._map, self.slot * CELL.size, load, now)
            self._written = (load, now)

    def least_other(self, now: float | None = None) -> int | None:
        """The fewest requests in flight at a live peer; None when no peer is live."""
        now = time.time() if now is None else now
        live = [load for cell, (load, at) in enumerate(CELL.iter_unpack(self._map))
                if 0 <= now - at < STALE and cell != self.slot]  # (ahead of the clock: it was set back)
        return min(live, default=None)

    def close(self) -> None:
        CELL.pack_into(self._map, self.slot * CELL.size, 0, 0.0)  # (stale at once: peers stop counting it)
        self._map.close()


class GatedSocket(socket.socket):
    """The daemon's listening socket (a dup) as this front accepts on it (asyncio calls
    accept() when it is readable): declined (BlockingIOError: "nothing to accept") while this
    front's load exceeds a live peer's, for at most DEFER seconds of an episode; then taken.
    `load()`: its open connections; those it accepted since the last `publish()` count too
    (the server registers them a loop turn later), so that a burst spreads as it arrives,
    but once only (those the server has registered since are in both)."""

    def __init__(self, sock: socket.socket, board: LoadBoard, load: Callable[[], int]):
        super().__init__(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        self.board, self.load = board, load
        self._episode = -1.0  # when the deferral under way began
        self._accepted = 0  # since the last publish()
        self._published = 0  # the load then

    def publish(self) -> None:
        """The load as it stands (a front calls this every PUBLISH seconds: its cell stays live)."""
        self._accepted, self._published = 0, self.load()
        self.board.publish(self._published)

    def accept(self):
        try:
            mine, declined = self._declines()
        except Exception:  # noqa: BLE001 (the board must never stop a front from accepting)
            mine, declined = 0, False
        if declined:
            os.sched_yield()  # (asyncio asks again at once, the socket still readable: the peer runs first)
            raise BlockingIOError  # (to asyncio: the backlog is empty; a peer's accept takes it)
        conn = super().accept()
        self._accepted += 1
        self.board.publish(mine + 1)  # (peers see it before this front's server does)
        return conn

    def _declines(self) -> tuple[int, bool]:
        """This front's load, and whether to leave the waiting connection to a peer."""
        now = time.time()  # (the board's clock)
        mine = max(self.load(), self._published + self._accepted)
        self.board.publish(mine, now)
        if now - self._episode > 2 * DEFER:  # (a connection waits after a quiet spell: a new episode)
            self._episode = now
        if now - self._episode >= DEFER or mine == 0:
            return mine, False
        least = self.board.least_other(now)
        return mine, least is not None and mine > least
