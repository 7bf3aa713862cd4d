"""The daemon's control plane: a ZeroMQ ROUTER for requests and a Unix socket that
hands out the arena's file descriptors. Every peer's uid is checked."""

from __future__ import annotations

import logging
import os
import socket
import threading
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


class PeerPolicy:
    """Who may talk to the daemon: its own uid, plus allow-listed uids and gids."""

    def __init__(self, uids: set[int], gids: set[int]):
        self.uids = {os.getuid(), *uids}
        self.gids = set(gids)

    def allows(self, uid: int, gid: int) -> bool:
        return uid in self.uids or gid in self.gids


def zmq_peer(frame: zmq.Frame) -> tuple[int, int, int]:
    """(pid, uid, gid) of a ZeroMQ ipc peer; libzmq appends ':uid:gid:pid' to the
    peer address it reads with SO_PEERCRED."""
    _, uid, gid, pid = frame.get("Peer-Address").rsplit(":", 3)
    return int(pid), int(uid), int(gid)


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
        self._router.bind(control_address(state_dir))
        self._fd_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fd_sock.bind(str(fd_socket_path(state_dir)))
        self._fd_sock.listen(64)
        self._fd_sock.settimeout(0.2)
        for path in (state_dir / "control.sock", fd_socket_path(state_dir)):
            os.chmod(path, 0o600)
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
            if not poller.poll(200):
                continue
            frames = self._router.recv_multipart(copy=False)
            if len(frames) != 2:
                self.on_error()
                continue  # not from our client: no reply envelope to answer on
            identity, payload = frames
            reply = self._reply(payload.bytes, *zmq_peer(payload))
            self._router.send_multipart([identity.bytes, encode(reply)])

    def _serve_fds(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._fd_sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5)
                try:
                    self._send_fds(conn)
                except (OSError, ProtocolError) as e:
                    self.on_error()
                    log.warning("fd request failed: %s", e)

    def _send_fds(self, conn: socket.socket) -> None:
        pid, uid, gid = peer_credentials(conn)
        msg, stray = recv_with_fds(conn, max_fds=0)
        for fd in stray:
            os.close(fd)
        if not self.policy.allows(uid, gid):
            self.on_error()
            log.warning("refused arena fds to pid %d uid %d", pid, uid)
            send_with_fds(conn, {"ok": False, "error": f"uid {uid} is not allowed to use this daemon"}, [])
        elif msg.get("op") != "fds":
            send_with_fds(conn, {"ok": False, "error": f"unknown op {msg.get('op')!r} on the fd socket"}, [])
        else:
            handle, fds = self.fds()
            send_with_fds(conn, {"ok": True, "arena": handle}, fds)

    def close(self) -> None:
        self._stop.set()
        self._fd_sock.close()
        for t in self._threads:
            t.join(timeout=2)
        self._router.close(linger=0)
        self._ctx.term()
        for path in (self.state_dir / "control.sock", fd_socket_path(self.state_dir)):
            path.unlink(missing_ok=True)
