"""Talking to a running daemon: requests over ZeroMQ, arena fds over the Unix socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import zmq

from preload.ipc.manifest import ArenaInfo
from preload.ipc.protocol import ProtocolError, control_address, decode, encode, fd_socket_path, recv_with_fds, send_with_fds


class DaemonUnavailable(ConnectionError):
    """No daemon answers on this state dir."""


class DaemonError(RuntimeError):
    """The daemon answered with an error."""


class DaemonClient:
    def __init__(self, state_dir: str | Path, timeout: float = 10.0):
        self.state_dir = Path(state_dir)
        self.timeout_ms = int(timeout * 1000)
        if not (self.state_dir / "control.sock").exists():
            raise DaemonUnavailable(f"no preload daemon is running on state dir {self.state_dir}")
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control_address(self.state_dir))

    def request(self, op: str, timeout: float | None = None, **fields) -> dict:
        timeout_ms = self.timeout_ms if timeout is None else int(timeout * 1000)
        self._sock.send(encode({"op": op, **fields}))
        if not self._sock.poll(timeout_ms):
            raise DaemonUnavailable(f"the daemon on {self.state_dir} did not answer {op!r} within {timeout_ms} ms")
        reply = decode(self._sock.recv())
        if not reply.get("ok"):
            raise DaemonError(reply.get("error", "unknown error"))
        return reply

    def arena_fds(self) -> tuple[ArenaInfo, list[int]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout_ms / 1000)
            try:
                sock.connect(str(fd_socket_path(self.state_dir)))
            except OSError as e:
                raise DaemonUnavailable(f"cannot reach {fd_socket_path(self.state_dir)}: {e.strerror}") from None
            send_with_fds(sock, {"op": "fds"}, [])
            reply, fds = recv_with_fds(sock)
        try:
            if not reply.get("ok"):
                raise DaemonError(reply.get("error", "unknown error"))
            return ArenaInfo.from_wire(reply.get("arena")), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DaemonClient", "DaemonError", "DaemonUnavailable", "ProtocolError"]
