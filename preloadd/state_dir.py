"""The daemon's state dir and its locks: one daemon per state dir, one per GPU.
(No torch here: `preload stop` reads the lock.)"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path


class StateDirError(RuntimeError):
    """The state dir or a device is not ours to use."""


def prepare_state_dir(path: Path, others_allowed: bool) -> None:
    """Create the state dir, or check that an existing one is ours: 0700, or 0711 (others
    may reach the sockets, not list the dir) when other uids or gids are allow-listed.
    Trusted only if nobody else could have made, replaced or redirected it: the dir itself
    no symlink and ours, every directory above it root's or ours and writable by no one
    else (unless sticky, as /tmp is)."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_ancestors(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:  # the dir itself, never what a symlink there points to
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise StateDirError(f"state dir {path} is not a directory of ours (a symlink or a file: {e.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StateDirError(f"state dir {path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})")
        os.fchmod(fd, 0o711 if others_allowed else 0o700)
    finally:
        os.close(fd)


def check_ancestors(directory: Path) -> None:
    """StateDirError unless every directory from `directory` up to / is root's or ours and
    writable by no one else (a sticky one, like /tmp, lets others write but not replace ours)."""
    for d in (directory, *directory.parents):
        st = os.stat(d)
        if st.st_uid not in (0, os.getuid()):
            raise StateDirError(f"{d}, above the state dir, belongs to uid {st.st_uid}: they could replace the state dir")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise StateDirError(f"{d}, above the state dir, is writable by others: they could replace the state dir")


class PidLock:
    """An flock on a file holding the owner's pid; the kernel drops it when the owner
    dies, however it dies. `what` names the resource in the refusal."""

    def __init__(self, path: Path, what: str):
        self.path = path
        try:
            # (never through a symlink someone planted: it would make us truncate its target)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except PermissionError:
            raise StateDirError(f"{what} is in use by another user's preload daemon ({path})") from None
        except OSError as e:
            raise StateDirError(f"{what}: lock file {path} is not a regular file ({e.strerror})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode().strip() or "?"
            os.close(self.fd)
            raise StateDirError(f"another preload daemon (pid {holder}) is running on {what}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        os.ftruncate(self.fd, 0)
        os.close(self.fd)


def lock_holder(path: Path) -> int | None:
    """The pid in a daemon lock file while a live daemon holds the lock, else None. Only
    a regular file of ours is read (not a symlink, not one another user planted)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def device_lock(device: str, uuid: str) -> PidLock:
    """One daemon per GPU, known by its UUID whatever CUDA_VISIBLE_DEVICES says."""
    return PidLock(Path(tempfile.gettempdir()) / f"preload-gpu-{uuid}.lock", f"device {device} (GPU {uuid})")


DAEMON_FILE = "daemon.json"  # the running daemon's pid and bound ports, for `preload status`


def write_private_json(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, readable by its owner only, replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
