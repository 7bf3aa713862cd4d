"""A supervised worker's link to its daemon: one SOCK_SEQPACKET socket made for this
worker alone (by the zygote, or by the daemon for a fresh interpreter).

Messages are JSON, one per packet:
  daemon -> worker  {"slot": k}                               serve slot k (a spare waits for this)
  worker -> daemon  {"event": "warm"}                         attached and warmed up, waiting for a slot
                    {"event": "ready", "kv_cache_bytes": n}   accepting on the shared socket
                    {"event": "beat", "steps": s, "busy": b}  every HEARTBEAT_INTERVAL seconds

The beats let the daemon find a worker that is frozen (no beat at all) or whose engine
has work but makes no step. When the daemon dies, a spare reads EOF and exits; a
serving worker keeps serving (its beats then fail, quietly).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("preload.worker")

HEARTBEAT_INTERVAL = 0.5  # seconds; the daemon's --worker-timeout is several of these


class DaemonLink:
    def __init__(self, fd: int, on_slot: Callable[[int], None] = lambda slot: None):
        self.sock, self.on_slot = socket.socket(fileno=fd), on_slot
        self._send_lock = threading.Lock()  # beats come from their own thread
        self._stop = threading.Event()

    def report(self, event: str, **fields) -> bool:
        """Tell the daemon; False once it is gone."""
        data = json.dumps({"event": event, **fields}).encode()
        try:
            with self._send_lock:
                self.sock.send(data)
            return True
        except OSError:
            return False

    def wait_for_slot(self) -> int | None:
        """Block until the daemon gives us a slot; None if it went away first."""
        try:
            data = self.sock.recv(1 << 16)
        except OSError:
            return None
        if not data:
            return None
        slot = int(json.loads(data)["slot"])
        self.on_slot(slot)
        return slot

    def beat(self, progress: Callable[[], tuple[int, bool]]) -> None:
        """Send beats from a background thread until the daemon is gone or `close`;
        progress() gives (engine steps so far, whether the engine has work)."""

        def run() -> None:
            while not self._stop.wait(HEARTBEAT_INTERVAL):
                steps, busy = progress()
                if not self.report("beat", steps=steps, busy=busy):
                    return

        threading.Thread(target=run, name="heartbeat", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
