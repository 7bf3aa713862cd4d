"""The daemon's control plane: a ZeroMQ ROUTER for requests and a Unix socket that
hands out the arena's file descriptors. Every peer's uid is checked."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from preload.ipc.protocol import (
    OPS,
    ProtocolError,
    control_address,
    decode,
    encode,
    fd_socket_path,
    peer_credentials,
    recv_with_fds,
    send_with_fds,
)

log = logging.getLogger("preload.daemon")

Handler = Callable[[dict, int], dict]  # (request, peer pid) -> reply fields


OWNER_OPS = ("restart", "shutdown")  # what only the daemon's own uid may ask
MAX_REQUEST = 64 << 10  # bytes of one control request at most
MAX_PENDING = 64  # fd-socket connections waiting for their request at most
FD_REQUEST_TIMEOUT = 2.0  # seconds an fd-socket peer has to send its request


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


UNKNOWN_PEER = (-1, -1, -1)


def zmq_peer(frame: zmq.Frame) -> tuple[int, int, int]:
    """(pid, uid, gid) of a ZeroMQ ipc peer; libzmq appends ':uid:gid:pid' to the
    peer address it reads with SO_PEERCRED. Peers without one (old ZMTP versions)
    are unknown, and unknown peers are refused."""
    try:
        _, uid, gid, pid = frame.get("Peer-Address").rsplit(":", 3)
        return int(pid), int(uid), int(gid)
    except (zmq.ZMQError, ValueError):
        return UNKNOWN_PEER


class ControlServer:
    def __init__(
        self,
        state_dir: Path,
        policy: PeerPolicy,
        handle: Handler,
        fds: Callable[[], tuple[dict, list[int]]],
        on_error: Callable[[], None],
    ):
        self.state_dir, self.policy, self.handle, self.fds, self.on_error = state_dir, policy, handle, fds, on_error
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # Requests are a few hundred bytes: libzmq drops a peer that sends more than this
        # instead of taking in a whole frame (up to MAX_MESSAGE) before we can look at it.
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        self._router.bind(control_address(state_dir))
        self._fd_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fd_sock.bind(str(fd_socket_path(state_dir)))
        self._fd_sock.listen(64)
        self._fd_sock.setblocking(False)
        # Owner only, unless the operator allow-listed other uids or gids: then anyone may
        # connect and the peer check alone decides.
        mode = 0o666 if policy.others_allowed else 0o600
        for path in (state_dir / "control.sock", fd_socket_path(state_dir)):
            os.chmod(path, mode)
        self._threads = [
            threading.Thread(target=self._serve_requests, name="control", daemon=True),
            threading.Thread(target=self._serve_fds, name="fds", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _reply(self, raw: bytes, pid: int, uid: int, gid: int) -> dict:
        if not self.policy.allows(uid, gid):
            self.on_error()
            log.warning("refused a request from pid %d uid %d gid %d", pid, uid, gid)
            return {"ok": False, "error": f"uid {uid} is not allowed to use this daemon"}
        try:
            msg = decode(raw)
            if msg.get("op") not in OPS:
                raise ProtocolError(f"unknown op {msg.get('op')!r}; known: {', '.join(OPS)}")
            if msg["op"] in OWNER_OPS and uid != os.getuid():
                # --allow-uid/--allow-gid let others attach to the weights, not run the daemon.
                self.on_error()
                log.warning("refused %s from pid %d uid %d: only the daemon's own uid may", msg["op"], pid, uid)
                return {"ok": False, "error": f"{msg['op']} is for the daemon's own uid ({os.getuid()}), not uid {uid}"}
            return {"ok": True, **self.handle(msg, pid)}
        except ProtocolError as e:
            self.on_error()
            log.warning("bad request from pid %d: %s", pid, e)
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug in one handler must not take the daemon down
            self.on_error()
            log.exception("request from pid %d failed", pid)
            return {"ok": False, "error": f"internal error: {e}"}

    def _serve_requests(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                identity, *payload = self._router.recv_multipart(copy=False)
                if len(payload) != 1:
                    self.on_error()
                    reply = {"ok": False, "error": f"expected one message frame, got {len(payload)}"}
                else:
                    reply = self._reply(payload[0].bytes, *zmq_peer(payload[0]))
                self._router.send_multipart([identity.bytes, encode(reply)])
            except zmq.ZMQError as e:  # one broken peer must not silence the daemon
                if self._stop.is_set():
                    return
                self.on_error()
                log.warning("control socket: %s", e)

    def _serve_fds(self) -> None:
        """One thread for every connection to the fd socket: the peer's credentials are
        checked as it connects, before anything it sends is read; then it has a moment to
        send its request. Idle connections cost a slot among MAX_PENDING, not a thread."""
        sel = selectors.DefaultSelector()
        sel.register(self._fd_sock, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[float, int | None]] = {}  # connection -> (deadline, uid if refused)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    if key.fileobj is self._fd_sock:
                        self._accept(sel, pending)
                    else:
                        conn = key.fileobj
                        sel.unregister(conn)
                        _, refused = pending.pop(conn)
                        self._fd_connection(conn, refused)
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in pending.items() if deadline < now]:
                    sel.unregister(conn)
                    del pending[conn]
                    conn.close()
                    self.on_error()
                    log.warning("fd socket: a peer sent nothing within %.0f s", FD_REQUEST_TIMEOUT)
        finally:
            for conn in pending:
                conn.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict) -> None:
        try:
            conn, _ = self._fd_sock.accept()
        except (BlockingIOError, TimeoutError, OSError):
            return
        if len(pending) >= MAX_PENDING:
            conn.close()
            self.on_error()
            log.warning("fd socket: %d connections already wait for their requests; one more refused", MAX_PENDING)
            return
        pid, uid, gid = peer_credentials(conn)
        refused = None if self.policy.allows(uid, gid) else uid
        if refused is not None:
            self.on_error()
            log.warning("refused arena fds to pid %d uid %d", pid, uid)
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
        pending[conn] = (time.monotonic() + FD_REQUEST_TIMEOUT, refused)

    def _fd_connection(self, conn: socket.socket, refused: int | None) -> None:
        """Answer a connection whose request is in: the arena's fds, or (`refused`: the
        peer's uid) the refusal."""
        with conn:
            conn.settimeout(FD_REQUEST_TIMEOUT)
            try:
                if refused is None:
                    self._send_fds(conn)
                else:
                    # Take in (one bounded read, never parsed) what the peer sent, so that our
                    # reply is not lost to a reset; then refuse.
                    conn.recv(1 << 16)
                    send_with_fds(conn, {"ok": False, "error": f"uid {refused} is not allowed to use this daemon"}, [])
            except (OSError, ProtocolError) as e:
                self.on_error()
                log.warning("fd request failed: %s", e)
                try:
                    send_with_fds(conn, {"ok": False, "error": str(e)}, [])
                except OSError:
                    pass

    def _send_fds(self, conn: socket.socket) -> None:
        msg, stray = recv_with_fds(conn, max_fds=0)
        for fd in stray:
            os.close(fd)
        if msg.get("op") != "fds":
            self.on_error()
            send_with_fds(conn, {"ok": False, "error": f"unknown op {msg.get('op')!r} on the fd socket"}, [])
        else:
            handle, fds = self.fds()
            send_with_fds(conn, {"ok": True, "arena": handle}, fds)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:  # each sees the flag within its 0.2 s poll
            t.join(timeout=2)
        self._fd_sock.close()
        self._router.close(linger=0)
        self._ctx.term()
        for path in (self.state_dir / "control.sock", fd_socket_path(self.state_dir)):
            path.unlink(missing_ok=True)
