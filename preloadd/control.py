"""The daemon's control plane: two Unix sockets in the state dir, served by one thread.

- control.sock: requests and their replies (length-prefixed msgpack, ipc/protocol.py); a
  connection may ask many (`preload restart` polls status on one, an attached worker
  holds its own for its "release");
- fds.sock: one request per connection, answered with the arena's file descriptors.

Every peer is known as it connects (SO_PEERCRED: pid, uid, gid), before anything it sends
is read. One process may hold PER_PROCESS connections at once and all peers together
MAX_CONNECTIONS: one more is told why and closed at once, so a flood of connections (from
one process, or from many) costs neither memory nor the attaching workers their turn
(`DaemonClient` waits for a busy daemon). A request must arrive whole within
REQUEST_TIMEOUT and be at most MAX_REQUEST bytes (refused as its length arrives, never
read in). Refusals of the same kind are logged once per LOG_EVERY seconds with a count.
Reads and writes never block: a peer that stops reading cannot stall the others.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from preload.ipc.protocol import (
    HEADER,
    OPS,
    ProtocolError,
    control_socket_path,
    decode,
    fd_socket_path,
    frame,
    peer_credentials,
)

log = logging.getLogger("preload.daemon")

Handler = Callable[[dict, int], dict]  # (request, peer pid) -> reply fields

OWNER_OPS = ("restart", "shutdown", "sleep", "wake")  # what only the daemon's own uid may ask
MAX_REQUEST = 64 << 10  # bytes of one request at most
PER_PROCESS = 16  # connections one process may hold at once
MAX_CONNECTIONS = 256  # connections of all peers at once
MAX_REFUSED = 32  # of which, at most, of peers refused (another uid: told so once, then dropped)
REQUEST_TIMEOUT = 2.0  # seconds from a request's first byte (fds.sock: from the connect) to its last
SEND_TIMEOUT = 10.0  # seconds a peer has to take in a reply
LOG_EVERY = 10.0  # seconds between two log lines of the same kind of refusal


class PeerPolicy:
    """Who may talk to the daemon: its own uid, plus allow-listed uids and gids."""

    def __init__(self, uids: set[int], gids: set[int]):
        self.uids = {os.getuid(), *uids}
        self.gids = set(gids)

    @property
    def others_allowed(self) -> bool:
        return bool(self.uids - {os.getuid()} or self.gids)

    def allows(self, uid: int, gid: int) -> bool:
        return uid in self.uids or gid in self.gids


class QuietLog:
    """Warnings of one kind at most once per LOG_EVERY seconds, with how many were held
    back: a flood of refusals must not fill the disk with the same line."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.held: Counter[str] = Counter()

    def warn(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -LOG_EVERY) < LOG_EVERY:
            self.held[kind] += 1
            return
        log.warning(msg, *args)
        self.last[kind] = now

    def flush(self) -> None:
        """How many of each kind were held back, once their LOG_EVERY is over."""
        now = time.monotonic()
        for kind in [k for k in self.held if now - self.last[k] >= LOG_EVERY]:
            log.warning("control: %d more like the last %r warning in %.0f s", self.held.pop(kind), kind,
                        now - self.last[kind])
            self.last[kind] = now


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    kind: str  # "control" or "fds"
    pid: int
    uid: int
    refusal: str | None  # why this peer gets nothing but an error (its uid), if it does
    deadline: float | None  # by when the request under way must be in
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    send_by: float | None = None
    closing: bool = False  # closed once its outbox is sent


class ControlServer:
    def __init__(
        self,
        state_dir: Path,
        policy: PeerPolicy,
        handle: Handler,
        fds: Callable[[int], tuple[dict, list[int]]],
        on_error: Callable[[], None],
    ):
        self.state_dir, self.policy, self.handle, self.fds, self.on_error = state_dir, policy, handle, fds, on_error
        self.quiet = QuietLog()
        self.per_process: Counter[int] = Counter()
        self.conns: dict[socket.socket, Connection] = {}
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._listeners = {}
        # Owner only, unless the operator allow-listed other uids or gids: then anyone may
        # connect and the peer check alone decides.
        mode = 0o666 if policy.others_allowed else 0o600
        for kind, path in (("control", control_socket_path(state_dir)), ("fds", fd_socket_path(state_dir))):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            os.chmod(path, mode)
            sock.listen(128)
            sock.setblocking(False)
            self._listeners[sock] = kind
            self._sel.register(sock, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    # ---- the loop ------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, events in self._sel.select(timeout=0.2):
                if key.fileobj in self._listeners:
                    self._accept(key.fileobj, self._listeners[key.fileobj])
                    continue
                conn = self.conns.get(key.fileobj)
                if conn is not None and events & selectors.EVENT_WRITE:
                    self._flush(conn)
                if conn is not None and events & selectors.EVENT_READ and conn.sock in self.conns:
                    self._read(conn)
            self._expire(time.monotonic())
            self.quiet.flush()

    def _accept(self, listener: socket.socket, kind: str) -> None:
        for _ in range(64):  # (a turn's share: the connections already here get theirs too)
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, OSError):
                return
            pid, uid, gid = peer_credentials(sock)
            sock.setblocking(False)
            busy = (f"{PER_PROCESS} connections of pid {pid}" if self.per_process[pid] >= PER_PROCESS else
                    f"{MAX_CONNECTIONS} connections" if len(self.conns) >= MAX_CONNECTIONS else None)
            if busy is not None:  # told at once, nothing read: the flood costs a socket for a moment
                self.on_error()
                self.quiet.warn("busy", "%s socket: %s already open; one more from pid %d refused", kind, busy, pid)
                try:
                    sock.send(frame({"ok": False, "busy": True, "error": f"the daemon has {busy} already open"}))
                except OSError:
                    pass
                sock.close()
                continue
            refusal = None if self.policy.allows(uid, gid) else f"uid {uid} is not allowed to use this daemon"
            if refusal is not None:
                self.on_error()
                self.quiet.warn("uid", "%s socket: refused pid %d uid %d gid %d", kind, pid, uid, gid)
                if sum(c.refusal is not None for c in self.conns.values()) >= MAX_REFUSED:
                    sock.close()  # (they may not crowd out the peers that are allowed)
                    continue
            # A refused peer, like any on the fd socket, has its moment to send its one request;
            # an allowed one may hold its control connection (an attached worker does).
            deadline = time.monotonic() + REQUEST_TIMEOUT if kind == "fds" or refusal else None
            conn = Connection(sock, kind, pid, uid, refusal, deadline)
            self.conns[sock] = conn
            self.per_process[pid] += 1
            self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)  # (fds a peer sends are dropped by the kernel: no ancillary buffer)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.closing:
            return  # (what comes after the one request we answer is not read)
        conn.inbox += data
        if conn.deadline is None:
            conn.deadline = time.monotonic() + REQUEST_TIMEOUT
        while len(conn.inbox) >= HEADER.size and not conn.closing:
            (length,) = HEADER.unpack_from(conn.inbox)
            if length > MAX_REQUEST:  # refused as its length arrives; nothing more is read
                self._fail(conn, "oversized", f"a request of {length} bytes refused (at most {MAX_REQUEST})")
                self._answer(conn, {"ok": False, "error": f"request of {length} bytes exceeds {MAX_REQUEST}"}, close=True)
                return
            if len(conn.inbox) < HEADER.size + length:
                return
            raw = bytes(conn.inbox[HEADER.size:HEADER.size + length])
            del conn.inbox[:HEADER.size + length]
            conn.deadline = time.monotonic() + REQUEST_TIMEOUT if conn.inbox else None
            self._request(conn, raw)

    def _request(self, conn: Connection, raw: bytes) -> None:
        if conn.refusal is not None:  # (its request taken in first, so that the refusal is not lost to a reset)
            self._answer(conn, {"ok": False, "error": conn.refusal}, close=True)
        elif conn.kind == "fds":
            self._send_fds(conn, raw)
        else:
            self._answer(conn, self._reply(raw, conn))

    def _reply(self, raw: bytes, conn: Connection) -> dict:
        try:
            msg = decode(raw)
            if msg.get("op") not in OPS:
                raise ProtocolError(f"unknown op {msg.get('op')!r}; known: {', '.join(OPS)}")
            if msg["op"] in OWNER_OPS and conn.uid != os.getuid():
                # --allow-uid/--allow-gid let others attach to the weights, not run the daemon.
                self._fail(conn, "owner", f"{msg['op']} refused: only the daemon's own uid may")
                return {"ok": False, "error": f"{msg['op']} is for the daemon's own uid ({os.getuid()}), not uid {conn.uid}"}
            return {"ok": True, **self.handle(msg, conn.pid)}
        except ProtocolError as e:
            self._fail(conn, "bad", f"bad request: {e}")
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug in one handler must not take the daemon down
            self.on_error()
            log.exception("request from pid %d failed", conn.pid)
            return {"ok": False, "error": f"internal error: {e}"}

    def _send_fds(self, conn: Connection, raw: bytes) -> None:
        try:
            msg = decode(raw)
            if msg.get("op") != "fds":
                raise ProtocolError(f"unknown op {msg.get('op')!r} on the fd socket")
        except ProtocolError as e:
            self._fail(conn, "bad", f"bad fd request: {e}")
            self._answer(conn, {"ok": False, "error": str(e)}, close=True)
            return
        try:
            handle, fds = self.fds(msg.get("dp_rank", 0))
        except ProtocolError as e:  # (no weights held now: asleep; no such data-parallel rank)
            self._answer(conn, {"ok": False, "error": str(e)}, close=True)
            return
        data = frame({"ok": True, "arena": handle})
        try:  # the fds ride on the first bytes, which a fresh connection's buffer takes at once
            sent = socket.send_fds(conn.sock, [data], fds)
        except OSError as e:
            self._fail(conn, "reply", f"fd reply failed: {e}")
            self._close(conn)
            return
        conn.outbox += data[sent:]
        conn.closing = True
        self._flush(conn)

    def _answer(self, conn: Connection, reply: dict, close: bool = False) -> None:
        conn.outbox += frame(reply)
        conn.closing = conn.closing or close
        self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        try:
            while conn.outbox:
                del conn.outbox[:conn.sock.send(conn.outbox)]
        except BlockingIOError:
            pass
        except OSError:
            self._close(conn)
            return
        if conn.outbox:
            conn.send_by = conn.send_by or time.monotonic() + SEND_TIMEOUT
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        elif conn.closing:
            self._close(conn)
        else:
            conn.send_by = None
            self._sel.modify(conn.sock, selectors.EVENT_READ)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if (c.deadline or now) < now or (c.send_by or now) < now]:
            if (conn.deadline or now) < now:
                self._fail(conn, "slow", f"no whole request within {REQUEST_TIMEOUT:.0f} s: dropped")
            else:
                self._fail(conn, "slow", f"its reply not taken in within {SEND_TIMEOUT:.0f} s: dropped")
            self._close(conn)

    def _fail(self, conn: Connection, kind: str, why: str) -> None:
        """A peer's fault: counted, and logged (once per LOG_EVERY per `kind`)."""
        self.on_error()
        self.quiet.warn(kind, "%s socket, pid %d: %s", conn.kind, conn.pid, why)

    def _close(self, conn: Connection) -> None:
        if self.conns.pop(conn.sock, None) is None:
            return
        self.per_process[conn.pid] -= 1
        if not self.per_process[conn.pid]:
            del self.per_process[conn.pid]
        self._sel.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)  # (it sees the flag within its 0.2 s select)
        for conn in list(self.conns.values()):
            self._close(conn)
        for sock in self._listeners:
            sock.close()
        self._sel.close()
        for path in (control_socket_path(self.state_dir), fd_socket_path(self.state_dir)):
            path.unlink(missing_ok=True)
