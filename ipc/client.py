"""Talking to a running daemon: requests over its control socket, arena fds over its fd
socket (both Unix sockets in the state dir, ipc/protocol.py's frames)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from preload.ipc.manifest import ArenaInfo
from preload.ipc.protocol import ProtocolError, control_socket_path, fd_socket_path, recv_with_fds, send_with_fds

BUSY_BACKOFF = (0.01, 0.2)  # seconds between tries while the daemon says it is busy: first, longest


class DaemonUnavailable(ConnectionError):
    """No daemon answers on this state dir."""


class DaemonError(RuntimeError):
    """The daemon answered with an error."""


class _Busy(Exception):
    """The daemon had too many connections open to take this one."""


class DaemonClient:
    """One connection to the daemon's control socket, for as many requests as its user
    makes (made again if it broke). A daemon that says it is busy (too many connections
    open) is asked again until the timeout."""

    def __init__(self, state_dir: str | Path, timeout: float = 10.0):
        self.state_dir = Path(state_dir)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        if not control_socket_path(self.state_dir).exists():
            raise DaemonUnavailable(f"no preload daemon is running on state dir {self.state_dir}")

    def request(self, op: str, timeout: float | None = None, **fields) -> dict:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        return self._until(deadline, lambda: self._ask(op, fields, deadline), f"answer {op!r}", timeout)

    def arena_fds(self, dp_rank: int = 0) -> tuple[ArenaInfo, list[int]]:
        """The fds of the daemon's arena for data-parallel rank `dp_rank` (its copy of the weights)."""
        deadline = time.monotonic() + self.timeout
        msg = {"op": "fds", "dp_rank": dp_rank} if dp_rank else {"op": "fds"}
        reply, fds = self._until(deadline, lambda: self._exchange(fd_socket_path(self.state_dir), msg,
                                                                   deadline, keep=False), "hand out the arena's fds",
                                 self.timeout)
        try:
            if not reply.get("ok"):
                raise DaemonError(reply.get("error", "unknown error"))
            return ArenaInfo.from_wire(reply.get("arena")), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _until(self, deadline: float, attempt, what: str, timeout: float):
        """`attempt()` until the daemon is not busy, within the deadline."""
        pause = BUSY_BACKOFF[0]
        while True:
            try:
                return attempt()
            except TimeoutError:
                raise DaemonUnavailable(f"the daemon on {self.state_dir} did not {what} within {timeout:g} s") from None
            except _Busy as e:
                if time.monotonic() + pause > deadline:
                    raise DaemonUnavailable(f"the daemon on {self.state_dir} stayed busy for {timeout:g} s: {e}") from None
                time.sleep(pause)
                pause = min(2 * pause, BUSY_BACKOFF[1])

    def _ask(self, op: str, fields: dict, deadline: float) -> dict:
        if self._sock is None:
            self._sock = self._connect(control_socket_path(self.state_dir), deadline)
        try:
            reply, stray = self._exchange(None, {"op": op, **fields}, deadline, keep=True)
        except BaseException:
            self.close()  # (a reply half read, or none: this connection is out of step)
            raise
        for fd in stray:
            os.close(fd)
        if not reply.get("ok"):
            raise DaemonError(reply.get("error", "unknown error"))
        return reply

    def _exchange(self, path: Path | None, msg: dict, deadline: float, keep: bool) -> tuple[dict, list[int]]:
        """One request and its reply: on the control connection (`path` None), or on a new
        connection to `path`, closed after."""
        sock = self._sock if path is None else self._connect(path, deadline)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                send_with_fds(sock, msg, [])
            except (BrokenPipeError, ConnectionResetError):
                pass  # (a busy daemon tells why and hangs up at once: its reply may still be there to read)
            try:
                reply, fds = recv_with_fds(sock, max_fds=16 if path is not None else 0)
            except (ProtocolError, ConnectionError) as e:
                raise DaemonUnavailable(f"the daemon on {self.state_dir} closed the connection ({e})") from None
            if reply.get("busy"):
                for fd in fds:
                    os.close(fd)
                raise _Busy(reply.get("error", "busy"))
            return reply, fds
        finally:
            if not keep:
                sock.close()

    def _connect(self, path: Path, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(str(path))
        except OSError as e:
            sock.close()
            if isinstance(e, TimeoutError):
                raise
            raise DaemonUnavailable(f"cannot reach {path}: {e.strerror}") from None
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DaemonClient", "DaemonError", "DaemonUnavailable", "ProtocolError"]
