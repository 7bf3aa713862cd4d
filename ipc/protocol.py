"""The control protocol between the daemon and its clients.

Requests and replies are msgpack maps carrying the protocol version `v`; never
pickle; each framed by its length (4 bytes, big-endian). Requests travel over a Unix
socket (`control.sock`); arena file descriptors over one beside it (`fds.sock`) with
SCM_RIGHTS. Both live in the state dir (0700) with mode 0600, and the daemon checks
each peer's credentials as it connects (preloadd/control.py).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

import msgpack

# 2: the manifest's tensors travel as columns (ipc.layout.Layout).
# 3: the manifest is typed (ipc.manifest); workers report to the daemon on their own link, not here.
PROTOCOL_VERSION = 3
OPS = ("hello", "manifest", "status", "release", "shutdown", "restart", "sleep", "wake")
MAX_MESSAGE = 64 << 20  # a manifest of a very large model stays far below this


class ProtocolError(ValueError):
    pass


def default_state_dir(create: bool = False) -> Path:
    """$XDG_RUNTIME_DIR/preload; else /run/preload for root; else this uid's own dir in the
    temp dir, made as mkdtemp makes one (`preload-$UID-` and a random suffix, 0700, never a
    path that exists already): no other user can take its name first, and it is found again
    by its owner and mode (a directory, not a link, of this uid, closed to everyone else),
    never by its name alone; the newest such if several. With none, `create` (preload start)
    makes it; a command that only looks gets the pattern searched, where no daemon is."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "preload"
    uid = os.getuid()
    if uid == 0:
        return Path("/run/preload")
    temp = Path(tempfile.gettempdir())
    ours = []
    for path in temp.glob(f"preload-{uid}-*"):
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            ours.append((st.st_mtime, str(path)))
    if ours:
        return Path(max(ours)[1])
    return Path(tempfile.mkdtemp(prefix=f"preload-{uid}-")) if create else temp / f"preload-{uid}-*"


LOG_BYTES, LOG_BACKUPS = 16 << 20, 3  # a state dir's logs are rotated past this size, this many kept


def open_log(path: Path | str) -> int:
    """An fd appending to one of the state dir's logs (0600) that a process's stdout and
    stderr go to (a worker's, the keeper's): such a file cannot be rotated under the
    process writing it, so it is rotated here, as a process opens it, once past LOG_BYTES
    (path.1 .. path.LOG_BACKUPS, the oldest dropped). Never through a symbolic link (it
    would write wherever the link points): a link there is refused, naming it."""
    path = Path(path)
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size > LOG_BYTES:
            for i in range(LOG_BACKUPS - 1, 0, -1):
                older = path.with_name(f"{path.name}.{i}")
                if older.exists():
                    older.replace(path.with_name(f"{path.name}.{i + 1}"))
            path.replace(path.with_name(f"{path.name}.1"))
    except FileNotFoundError:
        pass  # (a first start, or another process of the same log rotated it just now)
    return open_own(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)


def open_own(path: Path | str, flags: int) -> int:
    """os.open of a file in the state dir (0600 if made), never through a symbolic link:
    one found there is refused with an OSError that says so (not ELOOP's "Too many levels
    of symbolic links")."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"{path} is a symbolic link, which preload never writes through; remove it") from None
        raise


def log_output_to(path: Path | str) -> None:
    """This process's stdout and stderr, from now on, appended to `path` (open_log)."""
    fd = open_log(path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def control_socket_path(state_dir: Path) -> Path:
    return Path(state_dir) / "control.sock"


def fd_socket_path(state_dir: Path) -> Path:
    return state_dir / "fds.sock"


def workers_socket_path(state_dir: Path) -> Path:
    """Where a daemon takes over the workers a dead one of its state dir left (worker/link.py)."""
    return Path(state_dir) / "workers.sock"


def slot_socket_path(state_dir: Path, slot: int) -> Path:
    """Where a slot's front and its engine cores talk (worker/core_channel.py)."""
    return Path(state_dir) / f"slot-{slot}.sock"


def encode(msg: dict) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **msg}, use_bin_type=True)


def decode(data: bytes) -> dict:
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"malformed message: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("malformed message: not a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} not supported; this daemon speaks {PROTOCOL_VERSION}")
    return msg


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


HEADER = struct.Struct("!I")  # a frame's length


def frame(msg: dict) -> bytes:
    """`msg` encoded, its length first."""
    data = encode(msg)
    return HEADER.pack(len(data)) + data


def send_with_fds(sock: socket.socket, msg: dict, fds: list[int]) -> None:
    """One length-prefixed message, the fds riding on its first bytes. The rest goes
    after them: one sendmsg may take only part of a large message (a socket with a
    timeout does not block until all of it is sent), and the rest must still follow."""
    data = frame(msg)
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def recv_with_fds(sock: socket.socket, max_fds: int = 16) -> tuple[dict, list[int]]:
    """One length-prefixed message and the fds that came with it (on its first bytes).
    Nothing past it is read: replies to requests sent together stay apart."""
    head, fds, _, _ = socket.recv_fds(sock, HEADER.size, max_fds)
    try:
        if not head:
            raise ProtocolError("connection closed")
        (length,) = HEADER.unpack(head + _recv_exactly(sock, HEADER.size - len(head)))
        if length > MAX_MESSAGE:
            raise ProtocolError(f"message of {length} bytes exceeds {MAX_MESSAGE}")
        return decode(_recv_exactly(sock, length)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed mid-message")
        data += chunk
    return bytes(data)
