"""A supervised worker's link to its daemon: one SOCK_SEQPACKET socket made for this
worker alone (by the zygote, or by the daemon for a fresh interpreter).

Messages are JSON, one per packet:
  daemon -> worker  {"slot": k, "takeover": why}             serve slot k (a spare waits for this); why:
                                                              "first", "died" (the slot's last core died) or
                                                              "restart" (its front hands the requests over)
                    {"slot": k, ..., "kv_cache_bytes": n, "kv_memory_bytes": m} + fd
                                                              ... in the KV memory the slot's last worker left
                    {"sleeping": true, "level": n}            to a front (`listen`): `preload sleep` killed its
                                                              slot's cores (level 1 or 2); its requests wait
                    {"sleeping": false}                       to a front: `preload wake`; the slot's new cores
                                                              follow, each saying hello as a restart's does
                    {"release": true}                         to a spare kept through a level-1 sleep: let go
                                                              of the daemon's memory, its addresses kept
                    {"remap": true, "arena": {"transport": t, "size": n, "device": d}, "fingerprint": f} + fd
                                                              to that spare at the wake: the weights again, at
                                                              those addresses (preloadd/sleeping.py)
  worker -> daemon  {"event": "warm"}                         attached and warmed up, waiting for a slot
                    {"event": "ready", "kv_cache_bytes": n, "kv_memory_bytes": m} + fd
                                                              accepting on the shared socket; the fd of its KV
                                                              memory (ipc/kv_memory.py), for the slot's next worker
                    {"event": "beat", "steps": s, "busy": b}  every HEARTBEAT_INTERVAL seconds
                    {"event": "released"}, {"event": "remapped"}, {"event": "kept_failed", "why": w}
                                                              a kept spare: done, or it cannot be kept

The beats let the daemon find a worker that is frozen (no beat at all) or whose engine
has work but makes no step. When the daemon dies, a spare reads EOF and exits; a
serving worker keeps serving and, every REJOIN_INTERVAL, tries the socket where a new
daemon of its state dir takes over the workers the last one left (preloadd/orphans.py):
  worker -> daemon  {"event": "adopt", "pid": p, "slot": k, "fingerprint": f, "kv_cache_bytes": n,
                     "kv_memory_bytes": m, "listen": [host, port]} + the fd of its KV memory
  daemon -> worker  {"adopted": true}       supervised again: beats go on the new link
                    {"retire": "why"}       drain and exit (the slot gets a fresh worker)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from preload.ipc.protocol import workers_socket_path

log = logging.getLogger("preload.worker")

HEARTBEAT_INTERVAL = 0.5  # seconds; the daemon's --worker-timeout is several of these
REJOIN_INTERVAL = 0.05  # seconds between tries to reach a new daemon once ours is gone (a failed connect: microseconds)


class KvOffer(NamedTuple):
    """The KV memory the slot's last worker left: its fd (now ours), the engine's
    budget (kv_cache_bytes) and the memory's size."""

    fd: int
    kv_cache_bytes: int
    kv_memory_bytes: int


class DaemonLink:
    """`rejoin`: the state dir's socket to try once the daemon is gone, and `on_retire`
    what to do when a new daemon says no (drain and exit). `on_sleep(sleeping, level)`: a
    front's, called from `listen`'s thread when the daemon puts its slot to sleep or wakes it."""

    def __init__(self, fd: int, on_slot: Callable[[int], None] = lambda slot: None, state_dir: Path | None = None,
                 on_retire: Callable[[str], None] = lambda why: None,
                 on_sleep: Callable[[bool, int | None], None] = lambda sleeping, level: None):
        self.sock, self.on_slot, self.on_retire = socket.socket(fileno=fd), on_slot, on_retire
        self.on_sleep = on_sleep
        self.rejoin_path = workers_socket_path(state_dir) if state_dir is not None else None
        self.slot: int | None = None
        self.takeover = "first"  # why this worker got its slot (a core tells its front: worker/front.py)
        self.claim: dict = {}  # what a new daemon is told of us: fingerprint, KV sizes, the API address served
        self.kv_fd = -1  # our KV memory's fd: with `ready`, and to a new daemon with the claim
        self.kv_offer: KvOffer | None = None
        self._send_lock = threading.Lock()  # beats come from their own thread
        self._stop = threading.Event()

    def report(self, event: str, fds: tuple[int, ...] = (), **fields) -> bool:
        """Tell the daemon (with `fds`); False once it is gone."""
        data = json.dumps({"event": event, **fields}).encode()
        try:
            with self._send_lock:
                socket.send_fds(self.sock, [data], list(fds)) if fds else self.sock.send(data)
            return True
        except OSError:
            return False

    def wait_for_slot(self, let_go: Callable[[], None], map_again: Callable[[dict, list[int]], None]) -> int | None:
        """Block until the daemon gives us a slot; None if it went away first. Meanwhile a
        spare kept through a sleep lets go of the daemon's memory when told (`let_go`) and
        maps it again at the wake (`map_again(msg, fds)`), saying so, or why it cannot."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            except OSError:
                return None
            if not data:
                return None
            msg = json.loads(data)
            if "slot" in msg:
                break
            try:
                if msg.get("release"):
                    let_go()
                    self.report("released")
                elif msg.get("remap"):
                    t = time.monotonic()
                    map_again(msg, fds)  # (takes the fd, or closes it)
                    self.report("remapped")
                    log.info("kept through the sleep: the weights mapped again in %.3f s", time.monotonic() - t)
                else:
                    for fd in fds:  # (nothing else comes with one)
                        os.close(fd)
            except Exception as e:  # noqa: BLE001 (the daemon kills a spare it cannot keep; it says why here)
                log.warning("cannot be kept through the sleep: %s", e)
                self.report("kept_failed", why=f"{type(e).__name__}: {e}")
        slot = int(msg["slot"])
        self.takeover = str(msg.get("takeover", "first"))
        if fds:
            self.kv_offer = KvOffer(fds[0], int(msg["kv_cache_bytes"]), int(msg["kv_memory_bytes"]))
        self.on_slot(slot)
        self.slot = slot
        return slot

    def beat(self, progress: Callable[[], tuple[int, bool]]) -> None:
        """Send beats from a background thread until the daemon is gone or `close`;
        progress() gives (engine steps so far, whether the engine has work)."""

        def run() -> None:
            while not self._stop.wait(HEARTBEAT_INTERVAL):
                steps, busy = progress()
                if self.report("beat", steps=steps, busy=busy):
                    continue
                if self.slot is None or self.rejoin_path is None:
                    return  # a spare: it exits on the EOF wait_for_slot reads
                log.warning("the daemon is gone; serving on, and waiting for a new one on %s", self.rejoin_path)
                while not self._stop.is_set() and not self._rejoin():
                    self._stop.wait(REJOIN_INTERVAL)

        threading.Thread(target=run, name="heartbeat", daemon=True).start()

    def listen(self) -> None:
        """Read what the daemon tells a serving front, from a background thread, until
        `close`: on our link, and on a new daemon's once it adopted us."""

        def run() -> None:
            while not self._stop.is_set():
                sock = self.sock
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:  # the daemon is gone: the beats look for a new one
                    while sock is self.sock and not self._stop.wait(REJOIN_INTERVAL):
                        pass
                    continue
                try:
                    msg = json.loads(data)
                    if "sleeping" not in msg:
                        raise KeyError("sleeping")
                    sleeping = bool(msg["sleeping"])
                    self.on_sleep(sleeping, int(msg.get("level") or 1) if sleeping else None)
                except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
                    log.warning("a message from the daemon not handled (%r: %s): dropped", data[:200], e)

        threading.Thread(target=run, name="daemon-link", daemon=True).start()

    def _rejoin(self) -> bool:
        """One try to be taken over by a new daemon: True once settled (adopted, or told to
        retire), False to try again later."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(5.0)
            sock.connect(str(self.rejoin_path))
            claim = json.dumps({"event": "adopt", "pid": os.getpid(), "slot": self.slot, **self.claim}).encode()
            socket.send_fds(sock, [claim], [self.kv_fd] if self.kv_fd >= 0 else [])
            reply = json.loads(sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            sock.close()
            return False
        if reply.get("adopted"):
            sock.settimeout(None)
            with self._send_lock:
                self.sock.close()
                self.sock = sock
            log.info("taken over by the daemon on %s", self.rejoin_path)
            return True
        sock.close()
        if "retire" in reply:
            log.warning("the new daemon retires this worker: %s", reply["retire"])
            self.on_retire(str(reply["retire"]))
            return True
        return False

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
